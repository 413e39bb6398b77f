"""Every message on the wire, as msgspec Structs (msgpack; tagged unions; no pickle).

msgspec refuses unions that mix array-like and map-like Structs, so every message of
a union is map-like; the step plan broadcast to ranks (one type, no union) is array-like.

One union per direction and one typed decoder each, so a service can only ever receive
the messages meant for it; anything else is a ``DecodeError`` that the receiver counts,
logs and answers, never a crash. Every request-scoped message carries ``request_id`` and
``trace_id``. New fields get defaults; array-like hot-path messages only ever grow at
the end.
"""

from __future__ import annotations

from typing import Any, Generic, TypeVar

import msgspec

from pdserve.common.engine.kv_layout import KVLayout
from pdserve.common.engine.sampling_params import SamplingParams, TokenLogprobs

# 2: HandshakeReply's backend fields moved into its opaque payload
PROTOCOL_VERSION = 2


class Message(msgspec.Struct, tag=True, kw_only=True, forbid_unknown_fields=True):
    """Base of every wire message: tagged with its class name."""


# -- client <-> router (the ZMQ SDK) ------------------------------------------------------


class ChatMessage(msgspec.Struct, kw_only=True):
    role: str
    content: str


class Generate(Message, kw_only=True, omit_defaults=True):
    request_id: str = ""  # empty: the router assigns one
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    messages: list[ChatMessage] | None = None  # chat: rendered with the model's template
    sampling: SamplingParams = SamplingParams()
    stream: bool = True
    # vLLM's: lower is served first, at the router and in the engines' waiting lines
    priority: int = 0


class Abort(Message, kw_only=True):
    request_id: str
    trace_id: str = ""


class TokenChunk(Message, kw_only=True, omit_defaults=True):
    request_id: str
    trace_id: str
    token_ids: list[int]
    text: str
    # decode's wall-clock marks of the request (common/runtime/ttft.py), on the first chunk only;
    # empty ones are not encoded, so peers without the field still read every other chunk
    timings: dict[str, float] = {}
    logprobs: list[TokenLogprobs] = []  # one per token of token_ids, when asked for
    # first chunk only, when SamplingParams.prompt_logprobs asked: entry i is the logprobs
    # of prompt token i + 1 given the tokens before it
    prompt_logprobs: list[TokenLogprobs] | None = None


class Usage(msgspec.Struct, kw_only=True):
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0


class Finished(Message, kw_only=True):
    request_id: str
    trace_id: str
    finish_reason: str  # "stop" | "length" | "abort"
    usage: Usage


class Failed(Message, kw_only=True):
    request_id: str
    trace_id: str = ""
    reason: str  # a short code: bad_request, overloaded, kv_transfer, peer_down, internal
    message: str  # what failed and what to do, for a person


# -- router -> prefill ----------------------------------------------------------------------


class PrefillRequest(Message, kw_only=True, omit_defaults=True):
    request_id: str
    trace_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    # Who the request is for (the router's name of its client: an API key's index, an SDK
    # connection, a trusted ``user``) and its priority (lower first): the engine's waiting
    # line serves the client with the fewest tokens computed first (scheduler.py). Left
    # out of the encoding at their defaults, so older services read these messages.
    client: str = ""
    priority: int = 0


class Replica(msgspec.Struct, kw_only=True, frozen=True):
    """One producer rank holding a full copy of a request's KV blocks."""

    agent_name: str  # its NIXL agent
    side_channel: str  # ZMQ address serving its agent metadata and memory descriptors
    tp_rank: int = 0
    pcp_rank: int = 0


class KVHandle(msgspec.Struct, kw_only=True, frozen=True):
    engine_id: str
    epoch: int  # changes on every producer start: handles from an earlier life are refused
    layout: KVLayout
    block_ids: list[int]
    num_tokens: int
    replicas: list[Replica]
    lease_deadline: float  # unix time; decode heartbeats extend it
    # Table entries before block_ids[0]: behind a sliding window, never published (a model
    # whose every layer slides, common/engine/kv_groups.py); block_ids hold the rest.
    first_block: int = 0
    # A cache of several groups (common/engine/kv_groups.py): block_ids list group 0's kept
    # blocks, then group 1's, ...; these are the first kept table entries of groups 1...
    group_first_blocks: list[int] = []
    # Tokens a slot of each group stands for (DeepSeek-V4's compressed entries: 4, 128;
    # a group's table is 1 / rate as long, common/engine/kv_groups.py); empty: all 1.
    group_rates: list[int] = []
    # A secret of this request's lease, known only to whoever received the handle (the
    # router, then the one decode it picked): a Release or Heartbeat must name it.
    token: str = ""
    # Blocks the producer serves from its host tier (kv_host_cache_gb, issue #39): empty,
    # every block is on its device; else one entry per block_ids entry, the tier slot
    # holding that block (its block_ids entry then -1, which a decode older than this field
    # refuses as a negative id instead of reading the wrong device block) or -1 for a
    # device block. Tier slots are pinned under the lease as device blocks are.
    host_slots: list[int] = []


class PrefillDone(Message, kw_only=True, omit_defaults=True):
    request_id: str
    trace_id: str
    first_token: int
    num_cached_tokens: int
    handle: KVHandle
    timings: dict[str, float] = {}  # prefill's wall-clock marks (common/runtime/ttft.py)
    first_logprobs: TokenLogprobs | None = None  # when the request asked for logprobs
    prompt_logprobs: list[TokenLogprobs] | None = None  # as TokenChunk's, when asked for


# -- router -> decode -----------------------------------------------------------------------


class DecodeRequest(Message, kw_only=True, omit_defaults=True):
    request_id: str
    trace_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    first_token: int | None = None  # sampled by prefill; None: decode computes the prompt
    num_cached_tokens: int = 0
    handle: KVHandle | None = None  # None: colocated, decode prefills the prompt itself
    first_logprobs: TokenLogprobs | None = None  # prefill's, for first_token
    client: str = ""  # as PrefillRequest's
    priority: int = 0


# -- decode -> producer side channel ------------------------------------------------------


class Handshake(Message, kw_only=True):
    engine_id: str  # engine_id "" and epoch 0: whatever epoch the producer is in (connect ahead)
    epoch: int
    consumer: str  # the decode agent's name, for the producer's logs
    rank: int = 0  # which replica's agent metadata


class HandshakeReply(Message, kw_only=True):
    """One producer rank's handshake: what every transfer backend shares, and ``payload``,
    which only ``backend`` reads (common/transfer/registry.py; NIXL's: its agent metadata,
    the cache's address and memory kind, common/transfer/kv_transfer.py)."""

    engine_id: str
    epoch: int
    agent_name: str  # the replica's name in its backend (a NIXL agent)
    layout: KVLayout
    compat: dict[str, Any]  # model, dtype, block size, heads: checked by the consumer
    tp_rank: int = 0  # where this rank sits in its instance's TP x PCP grid
    tp_size: int = 1
    pcp_rank: int = 0
    pcp_size: int = 1
    backend: str = "nixl"
    payload: bytes = b""


class Heartbeat(Message, kw_only=True):
    """Decode still wants these requests' KV: extend their leases."""

    engine_id: str
    epoch: int
    request_ids: list[str]
    tokens: list[str] = []  # each request's KVHandle.token, in the order of request_ids


class Release(Message, kw_only=True):
    """Decode is done with a request's KV on one replica rank (sent as a NIXL
    notification; over the side channel when the notification cannot be sent)."""

    request_id: str
    trace_id: str = ""
    engine_id: str
    epoch: int
    rank: int = 0  # the replica rank released (matters for the side-channel fallback)
    token: str = ""  # the request's KVHandle.token: a release from anyone else is refused


class SideReply(Message, kw_only=True):
    ok: bool
    message: str = ""


# -- router <-> every service ---------------------------------------------------------------


class Ping(Message, kw_only=True):
    sent_at: float
    # Set by a router: it pings this often, and the service aborts its requests once its
    # pings stop (peer_timeout_seconds). A one-off ping (a probe, a test) sets nothing.
    interval: float = 0.0


class Pong(Message, kw_only=True):
    sent_at: float
    service: str
    instance: int
    ready: bool
    protocol_version: int = PROTOCOL_VERSION
    num_running: int = 0
    num_waiting: int = 0
    # its KV pools in blocks (0: not known): the router's prefix affinity guesses from
    # them which remembered blocks are still on the device and which in the host tier
    num_kv_blocks: int = 0
    num_host_blocks: int = 0
    # decode: the producers (engine ids, "prefill-N") its last pull from failed on the
    # transport, until it reaches them again; the router pairs it with other prefills
    unreachable_producers: list[str] = []


class MetricSample(msgspec.Struct, array_like=True):
    name: str
    kind: str  # counter | gauge | histogram
    labels: dict[str, str]
    value: float = 0.0
    buckets: list[tuple[float, float]] = []  # histogram: (upper bound, cumulative count)
    sum: float = 0.0


class MetricsQuery(Message, kw_only=True):
    pass


class MetricsReport(Message, kw_only=True):
    samples: list[MetricSample]


ClientToRouter = Generate | Abort
RouterToClient = TokenChunk | Finished | Failed
RouterToPrefill = PrefillRequest | Abort | Ping | MetricsQuery
PrefillToRouter = PrefillDone | Failed | Pong | MetricsReport
RouterToDecode = DecodeRequest | Abort | Ping | MetricsQuery
DecodeToRouter = TokenChunk | Finished | Failed | Pong | MetricsReport
ToSideChannel = Handshake | Heartbeat | Release
FromSideChannel = HandshakeReply | SideReply | Failed

T = TypeVar("T")

_encoder = msgspec.msgpack.Encoder()


def encode(msg: Message) -> bytes:
    return _encoder.encode(msg)


class Decoder(Generic[T]):
    """A typed decoder for one direction's union. Whatever the frame, it returns a message
    or raises ``msgspec.DecodeError`` (``ValidationError`` is one): tests/test_fuzz_protocol.py."""

    def __init__(self, union: Any) -> None:
        self._decoder = msgspec.msgpack.Decoder(union)

    def decode(self, frame: bytes) -> T:
        try:
            return self._decoder.decode(frame)
        except RecursionError:  # nesting in an ``Any`` field (HandshakeReply.compat)
            raise msgspec.DecodeError("the message is nested too deeply") from None
