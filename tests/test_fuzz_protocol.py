"""Fuzzing the wire: every decoder, the SDK's reply routing, live service sockets, and
the HTTP API under schemathesis.

The contract (docs/protocol.md): whatever arrives, a decoder returns a message of its
direction or raises ``msgspec.DecodeError`` (``ValidationError`` is one), and a message
that decodes can be validated with at most a ``PdserveError``. A live service counts
and logs what it cannot decode and keeps answering.
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdserve.common.engine.kv_layout import KVLayout
from pdserve.common.engine.sampling_params import SamplingParams
from pdserve.common.engine.step_plan import ScheduledSeq, StepPlan
from pdserve.common.errors import PdserveError
from pdserve.common.runtime import protocol as p
from pdserve.common.runtime.sockets import make_socket
from pdserve.services.router.client_common import Inbox

UNIONS = {
    "ClientToRouter": p.ClientToRouter, "RouterToClient": p.RouterToClient,
    "RouterToPrefill": p.RouterToPrefill, "PrefillToRouter": p.PrefillToRouter,
    "RouterToDecode": p.RouterToDecode, "DecodeToRouter": p.DecodeToRouter,
    "ToSideChannel": p.ToSideChannel, "FromSideChannel": p.FromSideChannel,
}  # fmt: skip
DECODERS = {name: p.Decoder(union) for name, union in UNIONS.items()}
# Typed decoders outside the unions: the step plan broadcast to ranks, a handle alone.
OTHER_DECODERS = [msgspec.msgpack.Decoder(StepPlan), msgspec.msgpack.Decoder(p.KVHandle)]

LAYOUT = KVLayout(
    num_blocks=64, num_layers=2, num_kv_heads=2, block_size=64, head_dim=32, dtype="float32"
)
SAMPLING = SamplingParams(max_tokens=1, temperature=0.5, top_p=0.9, seed=7, stop=("x",))
HANDLE = p.KVHandle(
    engine_id="fuzz-engine", epoch=1, layout=LAYOUT, block_ids=[0, 1], num_tokens=70,
    replicas=[p.Replica(agent_name="fuzz-engine-e1-r0", side_channel="tcp://127.0.0.1:9")],
    lease_deadline=1.0,
)  # fmt: skip
# fmt: off
SAMPLES: dict[str, list[p.Message]] = {
    "ClientToRouter": [
        p.Generate(request_id="fuzz-g", prompt="The sky is", sampling=SAMPLING),
        p.Generate(prompt_token_ids=[1, 2, 3], sampling=SAMPLING, stream=False),
        p.Generate(messages=[p.ChatMessage(role="user", content="hi")], sampling=SAMPLING),
        p.Abort(request_id="fuzz-g"),
    ],
    "RouterToClient": [
        p.TokenChunk(request_id="r", trace_id="t", token_ids=[5, 6], text="ab"),
        p.Finished(request_id="r", trace_id="t", finish_reason="stop",
                   usage=p.Usage(prompt_tokens=3, completion_tokens=2)),
        p.Failed(request_id="r", reason="bad_request", message="no"),
    ],
    "RouterToPrefill": [
        p.PrefillRequest(request_id="fuzz-p", trace_id="t", prompt_token_ids=[1, 2, 3], sampling=SAMPLING),
        p.Ping(sent_at=1.5), p.MetricsQuery(), p.Abort(request_id="fuzz-p"),
    ],
    "PrefillToRouter": [
        p.PrefillDone(request_id="r", trace_id="t", first_token=4, num_cached_tokens=0, handle=HANDLE),
        p.Pong(sent_at=1.0, service="prefill", instance=0, ready=True),
        p.MetricsReport(samples=[p.MetricSample("pdserve:requests", "counter", {"a": "b"}, 1.0, [(0.1, 2.0)])]),
    ],
    "RouterToDecode": [
        p.DecodeRequest(request_id="fuzz-d", trace_id="t", prompt_token_ids=[1, 2, 3], sampling=SAMPLING),
        p.DecodeRequest(request_id="fuzz-h", trace_id="t", prompt_token_ids=[1, 2, 3], sampling=SAMPLING,
                        first_token=5, handle=HANDLE),
    ],
    "DecodeToRouter": [p.Finished(request_id="r", trace_id="t", finish_reason="length",
                                  usage=p.Usage(prompt_tokens=1, completion_tokens=1))],
    "ToSideChannel": [
        p.Handshake(engine_id="fuzz-engine", epoch=1, consumer="fuzz"),
        p.Heartbeat(engine_id="fuzz-engine", epoch=1, request_ids=["a", "b"]),
        p.Release(request_id="a", engine_id="fuzz-engine", epoch=1),
    ],
    "FromSideChannel": [
        p.HandshakeReply(engine_id="e", epoch=1, agent_name="a", agent_metadata=b"\x00\x01", base_address=4096,
                         layout=LAYOUT, compat={"model": "m", "block_size": 64}, mem_type="DRAM"),
        p.SideReply(ok=False, message="stale"),
    ],
}
# fmt: on
FRAMES = [p.encode(m) for msgs in SAMPLES.values() for m in msgs]
OTHER_FRAMES = [msgspec.msgpack.encode(StepPlan(seqs=[ScheduledSeq("r", [1, 2], 0, [0], True)])),
                msgspec.msgpack.encode(HANDLE)]  # fmt: skip
MESSAGE_TYPES = sorted(
    {t for union in UNIONS.values() for t in union.__args__}, key=lambda t: t.__name__
)


def mutate(rng: random.Random, frame: bytes) -> bytes:
    """A few random edits of an encoded frame: flip, set, insert, delete bytes; truncate;
    extend; splice in a piece of another frame."""
    out = bytearray(frame)
    for _ in range(rng.randint(1, 4)):
        op = rng.randrange(7)
        at = rng.randrange(len(out) + 1)
        if op == 0 and out:
            out[min(at, len(out) - 1)] ^= 1 << rng.randrange(8)
        elif op == 1 and out:
            out[min(at, len(out) - 1)] = rng.choice(
                [0x00, 0x7F, 0x80, 0xC0, 0xC1, 0xCF, 0xD3, 0xDC, 0xDD, 0xFF]
            )
        elif op == 2:
            out[at:at] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 8)))
        elif op == 3:
            del out[at : at + rng.randint(1, 8)]
        elif op == 4:
            del out[at:]
        elif op == 5:
            out += bytes(rng.randrange(256) for _ in range(rng.randint(1, 16)))
        else:
            other = rng.choice(FRAMES)
            start = rng.randrange(len(other))
            out[at:at] = other[start : start + rng.randint(1, 24)]
    return bytes(out)


# msgpack-encodable values, nested: what a structure-aware fuzzer puts in a field
_SCALARS = (st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats()
            | st.text(max_size=12) | st.binary(max_size=12))  # fmt: skip
_VALUES = st.recursive(_SCALARS, lambda inner: st.lists(inner, max_size=4)
                       | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=12)  # fmt: skip


@st.composite
def structured(draw: st.DrawFn) -> bytes:
    """A map tagged with a real message type whose fields hold arbitrary values (past the
    msgpack layer, into validation), sometimes with a valid message's field values."""
    kind = draw(st.sampled_from(MESSAGE_TYPES))
    valid = next(
        (msgspec.to_builtins(m) for msgs in SAMPLES.values() for m in msgs if type(m) is kind), {}
    )
    fields = {}
    for name in kind.__struct_fields__:
        choice = draw(st.integers(0, 2))
        if choice == 0 and name in valid:
            fields[name] = valid[name]
        elif choice == 1:
            fields[name] = draw(_VALUES)
    return msgspec.msgpack.encode({"type": kind.__name__, **fields})


FUZZ_FRAMES = (st.binary(max_size=256) | structured()
               | st.builds(mutate, st.randoms(use_true_random=False), st.sampled_from(FRAMES)))  # fmt: skip


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


# -- live services ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def dep(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> Iterator[Any]:
    from tests.e2e import deployment

    # drain_seconds: fuzzed requests may still be in flight at the end; no need to wait.
    with deployment(
        tmp_path_factory.mktemp("dep"), model_dir, engine={"max_model_len": 128}, drain_seconds=1.0
    ) as d:
        yield d


def barrage(rng: random.Random, union: str, count: int) -> Iterator[list[bytes]]:
    """Frames for one socket: random bytes, structured garbage of every type, mutations
    of its own direction's messages and of everybody's, several frames at once."""
    own = [p.encode(m) for m in SAMPLES[union]] or FRAMES
    for i in range(count):
        kind = i % 5
        if kind == 0:
            yield [bytes(rng.randrange(256) for _ in range(rng.randint(0, 64)))]
        elif kind == 1:
            yield [mutate(rng, rng.choice(own))]
        elif kind == 2:
            yield [mutate(rng, rng.choice(FRAMES))]
        elif kind == 3:
            yield [rng.choice(FRAMES)]  # valid, but maybe for another direction
        else:
            yield [mutate(rng, rng.choice(own)) for _ in range(rng.randint(2, 3))]


@pytest.mark.slow
def test_live_sockets_count_garbage_and_keep_answering(dep: Any) -> None:
    """Fuzzed frames at the router's front door, every service's socket and the prefill
    side channel; afterwards each still answers and the deployment still serves. (The
    plain garbage-frame check is test_serving's; this one throws mutated messages.)"""
    from pdserve.services.router.client import Client
    from tests.test_serving import metrics, total

    before = total(metrics(dep.url), "pdserve:bad_messages_total")
    rng = random.Random(20240601)
    ctx = zmq.Context()
    targets = [(dep.cfg.front_address, "ClientToRouter")]
    targets += [(a.address, "RouterToPrefill") for a in dep.cfg.prefill_addresses]
    targets += [(a.side_channel, "ToSideChannel") for a in dep.cfg.prefill_addresses]
    targets += [(a.address, "RouterToDecode") for a in dep.cfg.decode_addresses]
    side = make_socket(ctx, zmq.DEALER, connect=dep.cfg.prefill_addresses[0].side_channel)
    for address, union in targets:
        sock = make_socket(ctx, zmq.DEALER, connect=address)
        for frames in barrage(rng, union, 150):
            sock.send_multipart(frames)
        # Prefills that a mutation left valid pin KV: release it as a decode would.
        while sock.poll(200):
            reply = sock.recv()
            try:
                done = DECODERS["PrefillToRouter"].decode(reply)
            except msgspec.DecodeError:
                continue
            if isinstance(done, p.PrefillDone):
                side.send(p.encode(p.Release(request_id=done.request_id, engine_id=done.handle.engine_id,
                                             epoch=done.handle.epoch)))  # fmt: skip
        if union == "RouterToDecode":  # the same request id twice: refused, the first runs on
            twice = p.DecodeRequest(request_id="fuzz-twice", trace_id="t", prompt_token_ids=[1, 2, 3],
                                    sampling=SamplingParams(max_tokens=20))  # fmt: skip
            sock.send(p.encode(twice))
            sock.send(p.encode(twice))
            replies = [
                ask(sock, None, DECODERS["DecodeToRouter"], (p.Failed, p.Finished))
                for _ in range(2)
            ]
            assert [type(r) for r in replies] == [p.Failed, p.Finished], replies
            assert "already in use" in replies[0].message
        if union in ("RouterToPrefill", "RouterToDecode"):
            answer = ask(
                sock,
                p.Ping(sent_at=2.0),
                DECODERS["PrefillToRouter" if "Prefill" in union else "DecodeToRouter"],
            )
            assert isinstance(answer, p.Pong), address
        elif union == "ToSideChannel":
            answer = ask(
                sock,
                p.Handshake(engine_id="nobody", epoch=0, consumer="fuzz"),
                DECODERS["FromSideChannel"],
            )
            assert isinstance(answer, p.SideReply) and not answer.ok, address
        sock.close()
    side.close()
    ctx.term()
    dep.check_alive()
    with Client(dep.cfg.front_address, timeout=120) as client:
        assert client.generate(prompt="The sky is", max_tokens=2).token_ids
    assert total(metrics(dep.url), "pdserve:bad_messages_total") >= before + 100


def ask(sock: zmq.Socket[Any], msg: p.Message | None, decoder: p.Decoder[Any],
        kinds: tuple[type, ...] = (p.Pong, p.SideReply, p.HandshakeReply)) -> Any:  # fmt: skip
    """Send ``msg`` (if any); the first reply of ``kinds`` for us (the barrage's late
    replies are skipped)."""
    if msg is not None:
        sock.send(p.encode(msg))
    while sock.poll(60_000):
        try:
            reply = decoder.decode(sock.recv())
        except msgspec.DecodeError:
            continue
        if isinstance(reply, kinds) and getattr(reply, "request_id", "fuzz-twice") == "fuzz-twice":
            return reply
    return None


# -- the HTTP API --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def http_server(model_dir: Path) -> Iterator[Any]:
    """The real aiohttp app over tests/http_fakes.py's FakeCore: the HTTP layer alone."""
    from pdserve.common.model.tokenizer import Tokenizer
    from tests.http_fakes import FakeCore, Server

    server = Server(FakeCore(Tokenizer.from_dir(model_dir)))
    yield server
    server.stop()


def test_http_api_under_schemathesis(http_server: Any) -> None:
    """Requests generated from the served OpenAPI document, valid and invalid ones: never
    a 5xx, every error in OpenAI's error body."""
    schemathesis = pytest.importorskip("schemathesis")
    requests = pytest.importorskip("requests")

    base = f"http://127.0.0.1:{http_server.port}"
    # The served document: narrowed to the model, so valid requests can succeed.
    schema = schemathesis.openapi.from_dict(requests.get(f"{base}/openapi.json", timeout=10).json())
    modes = schemathesis.GenerationMode
    cases = st.one_of(schema.as_strategy(modes.POSITIVE), schema.as_strategy(modes.NEGATIVE))
    session = requests.Session()

    @settings(
        max_examples=300, deadline=None, database=None, suppress_health_check=list(HealthCheck)
    )
    @given(case=cases)
    def check(case: Any) -> None:
        response = case.call(base_url=base, session=session, timeout=30)
        assert response.status_code < 500, (case.method, case.path, case.body, response.text[:500])
        if response.status_code >= 400:
            assert response.json()["error"]["message"], response.text

    check()


def test_http_bodies_nested_too_deeply_are_400(http_server: Any) -> None:
    from tests.http_fakes import request

    deep = b"[" * 100_000 + b"]" * 100_000
    bodies = {
        "/v1/chat/completions": b'{"messages":[{"role":"user","content":"x"}],"tools":'
        + deep
        + b"}",
        "/v1/completions": b'{"prompt":"x","max_tokens":2.0,"unknown":' + deep + b"}",
    }
    for path, body in bodies.items():
        status, _, data = request(http_server.port, "POST", path, body)
        assert status == 400 and b"nested too deeply" in data, data[:300]


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
