"""Every message on a rank process's pipe (services/ranks/process.py <-> group.py): one
Struct per kind, a tagged union per direction, msgpack-encoded (never pickle). Array-like:
a step plan crosses the pipe every model step. New fields get defaults; never reorder.

A rank answers every command but ``StartPull`` and ``Stop`` with one reply; it also sends
events nobody asked for (``Released``, ``Pulled``, ``PullFailed``), and ``RankError`` when
it cannot go on. A rank never hides a completion: every release and pull result is sent.
"""

from __future__ import annotations

import msgspec

from pdserve.common.engine.kv_layout import KVLayout
from pdserve.common.engine.prompt_logprobs import PromptScores
from pdserve.common.engine.step_plan import StepPlan
from pdserve.common.runtime import protocol as p
from pdserve.common.transfer.kv_pulls import PullSpec


class RankMessage(msgspec.Struct, tag=True, array_like=True):
    pass


# -- coordinator -> rank ----------------------------------------------------------------


class Step(RankMessage):
    """Execute a plan; rank 0 answers ``Logits``, the others ``StepDone``."""

    plan: StepPlan


class ReadBlocks(RankMessage):
    """Answered by ``BlockBytes``: tests compare replicas byte for byte."""

    block_ids: list[int]


class Connect(RankMessage):
    """A consumer rank connects to a producer life's replica ranks; ``Connected`` answers."""

    replies: list[p.HandshakeReply]


class StartPull(RankMessage):
    """Post this rank's READs of a request; ``Pulled`` or ``PullFailed`` follows."""

    request_id: str
    handle: p.KVHandle
    specs: list[PullSpec]


class ReleaseAll(RankMessage):
    """Release every replica rank of a handle; ``Unreached`` answers."""

    handle: p.KVHandle
    request_id: str
    trace_id: str


class Stop(RankMessage):
    pass


ToRank = Step | ReadBlocks | Connect | StartPull | ReleaseAll | Stop


# -- rank -> coordinator: replies -------------------------------------------------------


class Ready(RankMessage):
    handshake: p.HandshakeReply | None  # a producer rank's; None for a consumer
    layout: KVLayout


class StepDone(RankMessage):
    # this rank's prompt logprobs (common/engine/prompt_logprobs.py): under PCP each rank
    # scores its own positions
    prompt_logprobs: PromptScores = {}


class Logits(RankMessage):
    shape: list[int]
    data: bytes  # float32
    prompt_logprobs: PromptScores = {}


class BlockBytes(RankMessage):
    data: bytes  # float32


class Connected(RankMessage):
    error: str  # "": connected


class Unreached(RankMessage):
    indices: list[int]  # replicas no NIXL notification reached


class RankError(RankMessage):
    message: str


# -- rank -> coordinator: events ------------------------------------------------------------


class Released(RankMessage):
    releases: list[p.Release]


class Pulled(RankMessage):
    request_id: str
    num_bytes: int
    num_descriptors: int
    seconds: float


class PullFailed(RankMessage):
    request_id: str
    message: str


FromRank = (
    Ready
    | StepDone
    | Logits
    | BlockBytes
    | Connected
    | Unreached
    | RankError
    | Released
    | Pulled
    | PullFailed
)
Event = Released | Pulled | PullFailed
EVENTS = (Released, Pulled, PullFailed)

_encoder = msgspec.msgpack.Encoder()
to_rank = msgspec.msgpack.Decoder(ToRank)
from_rank = msgspec.msgpack.Decoder(FromRank)


def encode(msg: RankMessage) -> bytes:
    return _encoder.encode(msg)
