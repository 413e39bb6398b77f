"""Fuzzing the wire: every decoder, the SDK's reply routing and the rank pipes (live
service sockets and the HTTP API under schemathesis: tests/test_fuzz_live.py).

The contract (docs/protocol.md): whatever arrives, a decoder returns a message of its
direction or raises ``msgspec.DecodeError`` (``ValidationError`` is one), and a message
that decodes can be validated with at most a ``PdserveError``.
"""

from __future__ import annotations

import random
from collections import deque
from typing import Any

import msgspec
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdserve.common.engine.sampling_params import SamplingParams
from pdserve.common.errors import PdserveError
from pdserve.common.runtime import protocol as p
from pdserve.common.runtime.sockets import make_socket
from pdserve.services.router.client_common import Inbox
from tests.wire_corpus import (
    DECODERS,
    FRAMES,
    FUZZ_FRAMES,
    OTHER_DECODERS,
    OTHER_FRAMES,
    SAMPLES,
    UNIONS,
    mutate,
)


def check_decoded(msg: Any, union: Any) -> None:
    """A decoded message is of the union, and validating it fails only with PdserveError."""
    assert isinstance(msg, union.__args__)
    sampling = getattr(msg, "sampling", None)
    if sampling is not None:
        try:
            sampling.validate()
        except PdserveError:
            pass


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(frame=FUZZ_FRAMES, union=st.sampled_from(sorted(UNIONS)))
def test_every_decoder_gives_a_message_or_a_decode_error(frame: bytes, union: str) -> None:
    try:
        msg = DECODERS[union].decode(frame)
    except msgspec.DecodeError:  # ValidationError is a DecodeError
        return
    check_decoded(msg, UNIONS[union])


@settings(max_examples=200, deadline=None)
@given(rnd=st.randoms(use_true_random=False), which=st.integers(0, len(OTHER_DECODERS) - 1))
def test_step_plan_and_handle_decoders_too(rnd: random.Random, which: int) -> None:
    try:
        OTHER_DECODERS[which].decode(mutate(rnd, OTHER_FRAMES[which]))
    except msgspec.DecodeError:
        pass


def test_valid_frames_round_trip_and_stay_in_their_direction() -> None:
    for union, msgs in SAMPLES.items():
        for msg in msgs:
            assert DECODERS[union].decode(p.encode(msg)) == msg
    with pytest.raises(msgspec.DecodeError):  # a message for another direction
        DECODERS["RouterToPrefill"].decode(p.encode(SAMPLES["RouterToDecode"][0]))


def test_deep_nesting_is_a_decode_error_not_a_recursion_error() -> None:
    reply = SAMPLES["FromSideChannel"][0]
    frame = p.encode(msgspec.structs.replace(reply, compat={"k": None}))
    deep = frame.replace(b"\xa1k\xc0", b"\xa1k" + b"\x91" * 100_000 + b"\xc0")
    with pytest.raises(msgspec.DecodeError, match="nested too deeply"):
        DECODERS["FromSideChannel"].decode(deep)


def test_non_finite_sampling_is_refused() -> None:
    for temperature in (float("nan"), float("inf")):
        with pytest.raises(PdserveError, match="temperature"):
            SamplingParams(temperature=temperature).validate()


def test_oversized_frames_cost_the_sender_its_connection() -> None:
    """MAXMSGSIZE (make_socket): a frame over the limit is never allocated; the peer is
    disconnected, and the socket goes on serving others."""
    from pdserve.common.runtime.ports import free_port

    ctx = zmq.Context()
    address = f"tcp://127.0.0.1:{free_port()}"
    server = make_socket(ctx, zmq.ROUTER, bind=address, max_message_bytes=1024)
    big = make_socket(ctx, zmq.DEALER, connect=address)
    big.send(b"x" * 4096)
    small = make_socket(ctx, zmq.DEALER, connect=address)
    small.send(b"ok")
    assert server.poll(10_000)
    assert server.recv_multipart()[1] == b"ok"
    assert not server.poll(200)  # the big one never arrives
    ctx.destroy(linger=0)


@settings(max_examples=300, deadline=None)
@given(frames=st.lists(FUZZ_FRAMES | st.sampled_from(FRAMES), min_size=1, max_size=3))
def test_sdk_reply_routing_never_raises(frames: list[bytes]) -> None:
    queues: dict[str, Any] = {"r": deque(), "fuzz-g": deque()}
    Inbox().route(frames, queues)
    assert all(
        isinstance(e, p.TokenChunk | p.Finished | p.Failed) for q in queues.values() for e in q
    )


def test_rank_pipe_garbage_is_a_named_rank_failure() -> None:
    """The rank pipes are local and trusted; still, a message out of step fails the
    instance loudly (RankFailed, fatal: the service exits to be restarted), naming the rank."""
    from multiprocessing import Pipe

    from pdserve.services.ranks import messages as m
    from pdserve.services.ranks.group import RankFailed, RankGroup

    group = object.__new__(RankGroup)  # only its pipe: no rank processes
    ours, theirs = Pipe()
    group.conns, group.procs = [ours], [None]
    for raw in (
        b"\xc1",
        b"\x91" * 100_000 + b"\xc0",
        msgspec.msgpack.encode(5),
        msgspec.msgpack.encode([]),
        msgspec.msgpack.encode(["done"]),  # the tuples of before: an unknown tag now
        msgspec.msgpack.encode(["Logits", "not a shape", b""]),
    ):
        theirs.send_bytes(raw)
        with pytest.raises(RankFailed, match="rank 0"):
            group._recv(0)
    theirs.send_bytes(m.encode(m.StepDone()))
    assert group._recv(0) == m.StepDone()
