"""Fuzzing live services: their sockets count and log what they cannot decode and keep
answering, and the HTTP API holds under schemathesis (the contract: docs/protocol.md;
the decoders alone: tests/test_fuzz_protocol.py)."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdserve.common.engine.sampling_params import SamplingParams
from pdserve.common.runtime import protocol as p
from pdserve.common.runtime.sockets import make_socket
from tests.wire_corpus import DECODERS, FRAMES, SAMPLES, mutate

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
    from pdserve.common.model.checkpoint.tokenizer import Tokenizer
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
