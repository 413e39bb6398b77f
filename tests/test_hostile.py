"""Issue 19 against one real deployment (tests/hostile_tools.py): hostile or unlucky
messages and requests hurt only themselves. Each test shows the bad one refused with a
clear error, the legitimate ones finishing, the services still running and every KV pool
full afterwards. Router-side items: tests/test_hostile_router.py."""

from __future__ import annotations

import concurrent.futures
import json
import shutil
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq

from pdserve.cli.deployment import Deployment
from pdserve.common.engine.sampling_params import SamplingParams
from pdserve.common.runtime import protocol as p
from pdserve.common.runtime.curve import CurveKeys
from pdserve.common.runtime.sockets import make_socket
from tests.fault_tools import FaultReport, Peer, service_metrics, wait_until
from tests.hostile_tools import (
    FIRST_TOKEN_TIMEOUT,
    PROMPT,
    add_row,
    bad_messages,
    client,
    keys,
    roles,
    still_serving,
)

pytestmark = pytest.mark.slow


@pytest.fixture
def dep(hostile_dep: Deployment) -> Deployment:
    return hostile_dep


@pytest.fixture
def hold_path(hostile_hold: Path) -> Path:
    return hostile_hold


def test_malformed_decode_requests_are_refused_and_decode_lives(
    hostile_report: FaultReport, dep: Deployment
) -> None:
    """Issue item 1: replicas=[] or first_token=None ended decode's engine thread."""
    with Peer(dep.cfg.prefill_addresses[0].address, "prefill", keys(dep)) as pre:
        done = pre.ask(
            p.PrefillRequest(
                request_id="h1", trace_id="h1", prompt_token_ids=PROMPT, sampling=SamplingParams()
            )
        )[-1]
    assert isinstance(done, p.PrefillDone), done
    handle = done.handle
    good = p.DecodeRequest(
        request_id="h1",
        trace_id="h1",
        prompt_token_ids=PROMPT,
        sampling=SamplingParams(max_tokens=4),
        first_token=done.first_token,
        handle=handle,
    )
    forged = {
        "names no replica": msgspec.structs.replace(
            good, handle=msgspec.structs.replace(handle, replicas=[])
        ),
        "must carry the first token": msgspec.structs.replace(good, first_token=None),
        "is negative": msgspec.structs.replace(
            good, handle=msgspec.structs.replace(handle, block_ids=[-5] * len(handle.block_ids))
        ),
        "outside the vocabulary": msgspec.structs.replace(good, first_token=10**9),
        "characters, more than": msgspec.structs.replace(good, request_id="x" * 100_000),
    }
    address = dep.cfg.decode_addresses[0].address
    before = bad_messages(dep, address, "decode")
    with Peer(address, "decode", keys(dep)) as peer:
        for words, msg in forged.items():
            peer.send(msg)
            reply = wait_until(lambda: peer.sock.poll(100) and peer.decoder.decode(peer.sock.recv()),
                               10, f"the answer to {words!r}")  # fmt: skip
            assert isinstance(reply, p.Failed) and reply.reason == "bad_request", reply
            assert words in reply.message, (words, reply)
        # The genuine request with the same id still decodes: nothing of the forged ones stayed.
        replies = peer.ask(good)
    assert isinstance(replies[-1], p.Finished), replies[-1]
    assert bad_messages(dep, address, "decode") == before + len(forged)
    still_serving(dep)
    add_row(
        hostile_report,
        dep,
        "DecodeRequest with replicas=[], first_token=None, bad block/token ids, 100k-char id",
        len(forged) + 1,
        len(forged) + 1,
        "each Failed bad_request naming the fault, counted; the genuine one finished; decode alive",
    )


def test_a_tiny_temperature_is_greedy_and_poisons_no_batch(
    hostile_report: FaultReport, dep: Deployment
) -> None:
    """Issue item 5: temperature 1e-40 made the step's probabilities NaN and failed every
    request of that step with 500."""
    with client(dep) as c:
        greedy = c.generate(prompt_token_ids=PROMPT, max_tokens=6, ignore_eos=True).token_ids

    def run(temperature: float, k: int) -> list[int]:
        with client(dep) as c:
            ids = PROMPT if k == 0 else PROMPT + [k]
            result = c.generate(
                prompt_token_ids=ids, max_tokens=6, temperature=temperature, ignore_eos=True
            )
            return list(result.token_ids)

    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        tiny = pool.submit(run, 1e-40, 0)
        others = [pool.submit(run, 0.8, k) for k in range(1, 6)]
        assert tiny.result(timeout=120) == greedy
        assert all(len(f.result(timeout=120)) == 6 for f in others)
    still_serving(dep)
    add_row(
        hostile_report,
        dep,
        "temperature 1e-40 in a batch of 6",
        6,
        6,
        "greedy tokens for it; the 5 others finished",
    )


def test_internal_sockets_need_the_deployment_key_by_default(
    hostile_report: FaultReport, dep: Deployment
) -> None:
    """Issue item 2: with nothing configured any local process reached prefill and decode
    (a forged PrefillRequest was served, an Abort cut a user's stream). Now `up` makes a
    key pair in a private directory; a peer without it gets nothing, is counted, and the
    services keep serving."""
    assert dep.made_keys is not None
    assert dep.made_keys.stat().st_mode & 0o777 == 0o700
    assert (dep.made_keys / "client.key_secret").stat().st_mode & 0o077 == 0
    stranger_keys = CurveKeys.client(dep.made_keys)  # the right server key, a wrong client pair
    import zmq.auth

    other = dep.made_keys.parent / f"{dep.made_keys.name}-stranger"
    other.mkdir(mode=0o700)
    try:
        public, secret = zmq.auth.load_certificate(zmq.auth.create_certificates(other, "x")[1])
        assert secret is not None
        stranger_keys = CurveKeys(public_key=public, secret_key=secret,
                                  server_key=stranger_keys.server_key)  # fmt: skip
        forged = p.PrefillRequest(
            request_id="forged",
            trace_id="forged",
            prompt_token_ids=PROMPT,
            sampling=SamplingParams(),
        )
        for address, role in roles(dep):
            for curve in (None, stranger_keys):  # no CURVE at all; an unknown key
                with Peer(address, role, curve) as peer:
                    peer.send(forged if role == "prefill" else p.MetricsQuery())
                    assert not peer.sock.poll(1500), f"{role} answered a peer without the key"
    finally:
        shutil.rmtree(other, ignore_errors=True)
    m = service_metrics(dep.cfg.prefill_addresses[0].address, "prefill", keys(dep))
    assert m["pdserve:auth_failures"] >= 1
    still_serving(dep)
    add_row(
        hostile_report,
        dep,
        "peer without the deployment key (none / a stranger key) on prefill and decode",
        4,
        0,
        "no answer, auth_failures counted; services serving",
    )


def listening(pid: int) -> list[str]:
    """The local addresses TCP sockets of process ``pid`` listen on (``ss``)."""
    out = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, check=True).stdout
    return [line.split()[3] for line in out.splitlines() if f"pid={pid}," in line]


@pytest.mark.skipif(shutil.which("ss") is None, reason="needs ss (iproute2)")
def test_services_listen_only_where_host_says(dep: Deployment) -> None:
    """Issue item 8: NIXL's UCX listened on the external interface with host = 127.0.0.1."""
    for name in ("prefill-0", "decode-0"):
        addresses = listening(dep.procs[name].pid)
        assert addresses, name  # its ROUTER at least
        assert all(a.startswith("127.0.0.1:") for a in addresses), (name, addresses)


# -- item 4: ownership and deadlines ----------------------------------------------------------


def test_only_the_submitting_client_may_abort_and_ids_never_collide(
    hostile_report: FaultReport, dep: Deployment
) -> None:
    """Issue item 6: any SDK client could abort anyone's request; an SDK id equal to
    ``chatcmpl-<x-request-id>`` failed that HTTP request; 8 MB ids were accepted."""
    from pdserve.common.errors import RequestError

    with client(dep) as alice, client(dep) as bob:
        stream = alice.stream(prompt_token_ids=PROMPT, request_id="shared", max_tokens=24,
                              ignore_eos=True)  # fmt: skip
        chunks = [next(stream)]
        bob.abort("shared")  # not bob's: nothing happens
        mine = bob.generate(prompt_token_ids=PROMPT, request_id="shared", max_tokens=3)
        chunks += list(stream)
        assert sum(len(c.token_ids) for c in chunks) == 24
        assert mine.finish_reason == "length" and len(mine.token_ids) == 3
        with pytest.raises(RequestError, match="1-128 printable"):  # the SDK checks first
            bob.generate(prompt_token_ids=PROMPT, request_id="x" * 8_000_000, max_tokens=2)
        ctx: zmq.Context[Any] = zmq.Context()
        raw = make_socket(ctx, zmq.DEALER, connect=dep.cfg.front_address)
        try:  # and the router too, for a client that does not
            raw.send(p.encode(p.Generate(request_id="x" * 8_000_000, prompt_token_ids=PROMPT)))
            assert raw.poll(10_000), "no answer to an 8 MB request id"
            answer = p.Decoder(p.RouterToClient).decode(raw.recv())
        finally:
            raw.close(linger=0)
            ctx.term()
        assert isinstance(answer, p.Failed) and answer.reason == "bad_request", answer
        assert "more than 128" in answer.message

        def http() -> dict[str, Any]:
            body = json.dumps({"prompt": PROMPT, "max_tokens": 8, "ignore_eos": True}).encode()
            req = urllib.request.Request(
                f"{dep.url}/v1/completions",
                body,
                {"Content-Type": "application/json", "x-request-id": "same"},
            )
            with urllib.request.urlopen(req, timeout=120) as resp:
                return dict(json.loads(resp.read()))

        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            web = pool.submit(http)
            sdk = alice.generate(prompt_token_ids=PROMPT, request_id="cmpl-same", max_tokens=8)
            assert web.result(timeout=120)["id"] == "cmpl-same"
            assert sdk.request_id == "cmpl-same" and len(sdk.token_ids) == 8
    still_serving(dep)
    add_row(
        hostile_report,
        dep,
        "abort of another client's id; same id on two clients; SDK id = HTTP id; 8 MB id",
        5,
        5,
        "stream finished 24/24; ids kept apart; 8 MB id refused bad_request",
    )


def test_forged_releases_and_heartbeats_are_refused(
    hostile_report: FaultReport, dep: Deployment
) -> None:
    """Issue item 2: a Release from anyone freed pinned blocks of a request it never got;
    forged heartbeats pinned every prefill block. Both must carry the handle's token."""
    address = dep.cfg.prefill_addresses[0].address
    with Peer(address, "prefill", keys(dep)) as pre:
        done = pre.ask(
            p.PrefillRequest(
                request_id="lease-1",
                trace_id="lease-1",
                prompt_token_ids=PROMPT,
                sampling=SamplingParams(),
            )
        )[-1]
    assert isinstance(done, p.PrefillDone) and len(done.handle.token) == 32, done
    h = done.handle
    before = service_metrics(address, "prefill", keys(dep))["pdserve:kv_forged_messages"]
    forged: list[p.Message] = [
        p.Release(request_id="lease-1", engine_id=h.engine_id, epoch=h.epoch, token="0" * 32),
        p.Heartbeat(engine_id=h.engine_id, epoch=h.epoch, request_ids=["lease-1"]),
    ]
    ctx: zmq.Context[Any] = zmq.Context()
    side = make_socket(ctx, zmq.DEALER, connect=dep.cfg.prefill_addresses[0].side_channel,
                       curve=keys(dep))  # fmt: skip
    try:
        for msg in forged:
            side.send(p.encode(msg))

        def counted() -> dict[str, float] | None:
            m = service_metrics(address, "prefill", keys(dep))
            return m if m["pdserve:kv_forged_messages"] == before + 2 else None

        m = wait_until(counted, 10, "both forged messages to be refused")
        assert m["pdserve:kv_blocks_free"] < m["pdserve:kv_blocks_total"]  # still pinned
    finally:
        side.close(linger=0)
        ctx.term()
    still_serving(dep)  # the lease frees the blocks: the true decode never came
    add_row(
        hostile_report,
        dep,
        "forged Release and Heartbeat (no handle token) on the side channel",
        2,
        0,
        "refused, kv_forged_messages +2; blocks stayed pinned until the lease",
    )


def test_a_phase_past_its_deadline_fails_with_the_phase_named(
    hostile_report: FaultReport, dep: Deployment, hold_path: Path
) -> None:
    """Issue item 2/6: an unanswered phase left the router waiting forever."""
    from pdserve.services.router.client import GenerationFailed

    hold_path.touch()  # decode takes the request but starts no pull: no first token
    started = time.monotonic()
    try:
        with client(dep) as c, pytest.raises(GenerationFailed) as info:
            c.generate(prompt_token_ids=PROMPT, max_tokens=4)
    finally:
        hold_path.unlink(missing_ok=True)
    took = time.monotonic() - started
    err = info.value
    assert err.reason == "timeout", err
    assert "decode-0" in err.message and "first_token_timeout_seconds" in err.message, err
    still_serving(dep)  # decode dropped it on the router's Abort and released the producer
    add_row(
        hostile_report,
        dep,
        "no first token (pulls held)",
        1,
        1,
        "Failed timeout naming decode-0 and first_token_timeout_seconds",
        round(took, 2),
        FIRST_TOKEN_TIMEOUT + 5,
    )


# -- issue 50: grammars off the engine thread, schemas past the limits ----------------------


def _nested(levels: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "boolean"}
    for i in range(levels):
        schema = {"type": "object", "properties": {f"p{i % 10}": schema}}
    return schema


def test_deep_schemas_are_refused_and_structured_requests_are_served(
    hostile_report: FaultReport, dep: Deployment
) -> None:
    """Issue 50: a tool schema 360 levels deep froze every stream while it compiled on the
    engine thread, and one 250 deep with tool_choice required was a 500. Through the real
    router (its tokenizer process included) and engines: the deep ones are a 400 naming the
    limit (the SDK's schema text at the engines' compile worker), a schema within the
    limit is compiled off the engine thread and served, a stream beside them finishes."""
    from pdserve.common.engine.sampling_params import StructuredOutput
    from pdserve.services.router.client import GenerationFailed

    def chat(levels: int, choice: Any, max_tokens: int = 8) -> tuple[int, dict[str, Any]]:
        body = {"messages": [{"role": "user", "content": "call f"}], "max_tokens": max_tokens,
                "tools": [{"type": "function",
                           "function": {"name": "f", "parameters": _nested(levels)}}],
                "tool_choice": choice}  # fmt: skip
        req = urllib.request.Request(f"{dep.url}/v1/chat/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})  # fmt: skip
        try:
            with urllib.request.urlopen(req, timeout=120) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read())

    # xgrammar's one-time load (each of prefill and decode, ~10 s on a busy 2-core
    # machine) may outlast this deployment's 6 s first-token deadline: the router then
    # aborts the request while decode still waits for its grammar (it drops it and
    # releases its KV: still_serving below finds every pool full); the next one is served.
    small = StructuredOutput(kind="json", spec=json.dumps(_nested(2)))
    with client(dep) as c:
        for attempt in range(6):
            try:
                c.generate(prompt_token_ids=PROMPT, max_tokens=16, structured=small)
                break
            except GenerationFailed as exc:
                assert exc.reason == "timeout" and attempt < 5, exc
    with client(dep) as c, concurrent.futures.ThreadPoolExecutor(4) as pool:
        stream = pool.submit(c.generate, prompt_token_ids=PROMPT, max_tokens=48, ignore_eos=True)
        deep = [pool.submit(chat, levels, "required") for levels in (250, 360)]
        for future in deep:
            status, answer = future.result(timeout=120)
            assert status == 400 and answer["error"]["code"] == "nested_too_deeply", answer
            assert answer["error"]["param"] == "tools"
        spec = StructuredOutput(kind="json", spec=json.dumps(_nested(360)))
        with pytest.raises(GenerationFailed) as info:
            c.generate(prompt_token_ids=PROMPT, max_tokens=4, structured=spec)
        assert info.value.reason == "bad_request" and "nested more than 128" in info.value.message
        status, answer = chat(20, {"type": "function", "function": {"name": "f"}}, 400)
        assert status == 200, answer
        arguments = answer["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"]
        json.loads(arguments)  # held by the grammar compiled off the engine thread
        assert len(stream.result(timeout=120).token_ids) == 48
    still_serving(dep)
    add_row(
        hostile_report,
        dep,
        "tool schemas 250/360 levels deep (HTTP, required), schema text 360 deep (SDK)",
        5,
        5,
        "400 nested_too_deeply / bad_request naming the limit; a 20-level schema served; "
        "the stream beside them finished",
    )
