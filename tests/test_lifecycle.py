"""A service's life under systemd, on real processes: READY, WATCHDOG, STOPPING through
a real $NOTIFY_SOCKET; admission (Failed "overloaded"), and the drain on SIGTERM.

The decode service runs alone (colocated: it computes prompts itself), driven by a
DEALER standing in for the router. The router runs in front of a scripted decode: a
ROUTER socket in this test, so what is in flight when is decided here, not by timing.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq

from pdserve.common.engine.sampling_params import SamplingParams
from pdserve.common.runtime import protocol as p
from pdserve.common.runtime.ports import free_port_block
from pdserve.common.runtime.service_config import DeploymentConfig, load_config
from pdserve.services.router.client import Client, GenerationFailed

pytestmark = pytest.mark.slow

PROMPT = [1, 504, 3458, 282, 4649, 314]  # token ids: no tokenizer needed to send them


class Notifications(threading.Thread):
    """The manager's end of $NOTIFY_SOCKET: an abstract AF_UNIX datagram socket, read
    all the time as systemd does (the kernel queues only ~10 unread datagrams)."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.address = f"@pdserve-test-{uuid.uuid4().hex}"
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind("\0" + self.address[1:])
        self.fields: queue.Queue[str] = queue.Queue()
        self.seen: list[str] = []
        self.closed = threading.Event()
        self.sock.settimeout(0.2)
        self.start()

    def run(self) -> None:
        while not self.closed.is_set():
            try:
                datagram = self.sock.recv(4096).decode()
            except TimeoutError:
                continue
            for field in datagram.split("\n"):
                self.fields.put(field)

    def wait_for(
        self, field: str, proc: subprocess.Popen[bytes], timeout: float = 300.0
    ) -> list[str]:
        """Every field received since the last call, up to and including ``field``."""
        deadline = time.monotonic() + timeout
        start = len(self.seen)
        while time.monotonic() < deadline:
            assert proc.poll() is None, f"the service exited with {proc.returncode} before {field}"
            try:
                self.seen.append(self.fields.get(timeout=0.5))
            except queue.Empty:
                continue
            if self.seen[-1] == field:
                return self.seen[start:]
        raise AssertionError(f"no {field} within {timeout} s; got {self.seen}")

    def close(self) -> None:
        self.closed.set()
        self.join(5)
        self.sock.close()


def start(
    tmp: Path,
    role: str,
    cfg: DeploymentConfig,
    notifications: Notifications,
    watchdog_usec: int = 0,
) -> subprocess.Popen[bytes]:
    config = tmp / f"{role}.json"
    config.write_bytes(json.dumps(msgspec.to_builtins(cfg)).encode())
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PDSERVE_", "WATCHDOG_"))}
    env.update(
        {k: v for k, v in os.environ.items() if k in ("PDSERVE_CACHE_DIR", "PDSERVE_KERNELS")}
    )
    env["NOTIFY_SOCKET"] = notifications.address
    if watchdog_usec:
        env["WATCHDOG_USEC"] = str(watchdog_usec)
    args = [role] if role == "router" else [role, "--instance", "0"]
    with open(tmp / f"{role}.log", "wb") as log:  # the child keeps its own descriptor
        return subprocess.Popen([sys.executable, "-m", "pdserve", *args, "--config", str(config)],
                                stdout=log, stderr=subprocess.STDOUT, env=env)  # fmt: skip


def config(model_dir: Path, **flags: Any) -> DeploymentConfig:
    base = free_port_block(100)
    return load_config(
        None,
        model=str(model_dir),
        base_port=base,
        http_port=base + 99,
        torch_threads=1,
        colocated=True,
        engine={"kv_cache_memory_gb": 0.1, "max_model_len": 512},
        **flags,
    )


def stopped(proc: subprocess.Popen[bytes], timeout: float = 60.0) -> int | None:
    """The exit code within ``timeout``; else None, and the process is killed."""
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        return None


# -- decode: a real engine ------------------------------------------------------------------


class FakeRouter:
    """A DEALER to one service, as the router holds; replies sorted by request id."""

    def __init__(self, address: str, inbound: Any = p.DecodeToRouter) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(address)
        self.decoder: p.Decoder[Any] = p.Decoder(inbound)
        self.replies: dict[str, list[Any]] = {}

    def decode(self, rid: str, max_tokens: int) -> None:
        sampling = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        self.sock.send(
            p.encode(
                p.DecodeRequest(
                    request_id=rid, trace_id=f"t-{rid}", prompt_token_ids=PROMPT, sampling=sampling
                )
            )
        )

    def prefill(self, rid: str, num_tokens: int) -> None:
        prompt = (PROMPT * (num_tokens // len(PROMPT) + 1))[:num_tokens]
        msg = p.PrefillRequest(
            request_id=rid,
            trace_id=f"t-{rid}",
            prompt_token_ids=prompt,
            sampling=SamplingParams(max_tokens=4),
        )
        self.sock.send(p.encode(msg))

    def abort(self, rid: str) -> None:
        self.sock.send(p.encode(p.Abort(request_id=rid, trace_id=f"t-{rid}")))

    def ping(self) -> p.Pong:
        self.pong = None
        self.sock.send(p.encode(p.Ping(sent_at=time.time())))
        self.until(lambda: self.pong is not None)
        assert self.pong is not None
        return self.pong

    pong: p.Pong | None = None

    def until(self, done: Any, timeout: float = 120.0) -> Any:
        deadline = time.monotonic() + timeout
        while not done():
            assert self.sock.poll(max(1, int((deadline - time.monotonic()) * 1000))), (
                "no reply in time"
            )
            msg = self.decoder.decode(self.sock.recv())
            if isinstance(msg, p.Pong):
                self.pong = msg
            elif not isinstance(msg, p.MetricsReport):
                self.replies.setdefault(msg.request_id, []).append(msg)
        return done()

    def terminal(self, rid: str) -> Any:
        self.until(
            lambda: any(
                isinstance(m, p.Finished | p.Failed | p.PrefillDone)
                for m in self.replies.get(rid, [])
            )
        )
        return self.replies[rid][-1]

    def first_chunk(self, rid: str) -> None:
        self.until(lambda: any(isinstance(m, p.TokenChunk) for m in self.replies.get(rid, [])))

    def tokens(self, rid: str) -> list[int]:
        return [t for m in self.replies[rid] if isinstance(m, p.TokenChunk) for t in m.token_ids]

    def close(self) -> None:
        self.sock.close()
        self.ctx.term()


@pytest.fixture
def notifications() -> Iterator[Notifications]:
    n = Notifications()
    yield n
    n.close()


def test_decode_ready_watchdog_admission_and_drain(
    tmp_path: Path, model_dir: Path, notifications: Notifications
) -> None:
    cfg = config(model_dir, max_queued_requests=2, drain_seconds=120)
    proc = start(tmp_path, "decode", cfg, notifications, watchdog_usec=1_000_000)
    router = FakeRouter(cfg.decode_addresses[0].address)
    try:
        before = notifications.wait_for("READY=1", proc)
        assert any(f.startswith("STATUS=loading") for f in before)
        assert router.ping().ready  # READY=1 came once the service is really ready
        notifications.wait_for("WATCHDOG=1", proc, timeout=30)

        router.decode("a", 32)
        router.decode("b", 32)
        router.first_chunk("a")
        router.first_chunk("b")
        router.decode("c", 4)  # a third while two are in flight: over the limit
        refused = router.terminal("c")
        assert isinstance(refused, p.Failed) and refused.reason == "overloaded", refused
        assert "max_queued_requests" in refused.message

        proc.send_signal(signal.SIGTERM)
        notifications.wait_for("STOPPING=1", proc, timeout=30)
        router.decode("d", 4)  # after STOPPING=1: refused, the instance is going away
        late = router.terminal("d")
        assert isinstance(late, p.Failed) and late.reason == "draining", late
        for rid in ("a", "b"):  # in flight at SIGTERM: answered in full
            done = router.terminal(rid)
            assert isinstance(done, p.Finished) and done.finish_reason == "length", done
            assert len(router.tokens(rid)) == 32
        assert stopped(proc) == 0
    finally:
        router.close()
        stopped(proc, 0.1)


def test_decode_drain_deadline_fails_what_is_left(
    tmp_path: Path, model_dir: Path, notifications: Notifications
) -> None:
    cfg = config(model_dir, drain_seconds=0)
    proc = start(tmp_path, "decode", cfg, notifications)
    router = FakeRouter(cfg.decode_addresses[0].address)
    try:
        notifications.wait_for("READY=1", proc)
        router.decode("long", 400)
        router.first_chunk("long")
        proc.send_signal(signal.SIGTERM)
        failed = router.terminal("long")
        assert isinstance(failed, p.Failed) and failed.reason == "draining", failed
        assert "drain_seconds = 0" in failed.message
        assert 0 < len(router.tokens("long")) < 400
        assert stopped(proc) == 0
    finally:
        router.close()
        stopped(proc, 0.1)


def test_prefill_admission_and_drain(
    tmp_path: Path, model_dir: Path, notifications: Notifications
) -> None:
    cfg = config(model_dir, max_queued_requests=1, drain_seconds=120)
    proc = start(tmp_path, "prefill", cfg, notifications)
    router = FakeRouter(cfg.prefill_addresses[0].address, p.PrefillToRouter)
    try:
        notifications.wait_for("READY=1", proc)
        # A long prompt is seconds of prefill on CPU: the second arrives while it runs.
        router.prefill("long", 448)
        router.prefill("second", 8)
        refused = router.terminal("second")
        assert isinstance(refused, p.Failed) and refused.reason == "overloaded", refused
        router.abort("long")  # an aborted prefill answers nothing, yet frees its slot
        router.prefill("short", 8)
        assert isinstance(router.terminal("short"), p.PrefillDone)
        router.abort("short")  # no decode will pull it: its pinned KV is freed

        router.prefill("last", 448)
        router.ping()  # answered in order: "last" is in flight now
        proc.send_signal(signal.SIGTERM)
        notifications.wait_for("STOPPING=1", proc, timeout=30)
        router.prefill("late", 8)
        late = router.terminal("late")
        assert isinstance(late, p.Failed) and late.reason == "draining", late
        assert isinstance(router.terminal("last"), p.PrefillDone)  # in flight at SIGTERM: done
        # The drain also waits for pinned KV (a decode may be pulling it): once that is
        # released (here: aborted), the service exits 0.
        router.abort("last")
        assert stopped(proc) == 0
    finally:
        router.close()
        stopped(proc, 0.1)


def test_sigterm_while_loading_exits_0_at_once(
    tmp_path: Path, model_dir: Path, notifications: Notifications
) -> None:
    proc = start(tmp_path, "decode", config(model_dir), notifications)
    try:
        notifications.wait_for("STATUS=loading the model (decode 0)", proc, timeout=60)
        proc.send_signal(signal.SIGTERM)  # systemctl stop during a long weight load
        assert stopped(proc) == 0  # not an abort from the half-built engine thread
    finally:
        stopped(proc, 0.1)


# -- router: in front of a scripted decode ---------------------------------------------------


class ScriptedDecode(threading.Thread):
    """A decode instance that answers pings and holds every DecodeRequest until told to
    answer it (``send``); one thread owns the socket, the test talks through queues."""

    def __init__(self, address: str) -> None:
        super().__init__(daemon=True)
        self.address = address
        self.requests: queue.Queue[p.DecodeRequest] = queue.Queue()
        self.aborts: queue.Queue[str] = queue.Queue()
        self.outbox: queue.Queue[p.Message] = queue.Queue()
        self.stop = threading.Event()
        self.bound = threading.Event()
        self.ready = True  # False: answer pings as a draining instance does
        self.silent = False  # True: answer nothing, as a hung or killed one

    def run(self) -> None:
        ctx = zmq.Context()
        sock = ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.bind(self.address)
        self.bound.set()
        decoder: p.Decoder[Any] = p.Decoder(p.RouterToDecode)
        identity = b""
        while not self.stop.is_set():
            while not self.outbox.empty() and identity:
                sock.send_multipart([identity, p.encode(self.outbox.get())])
            if not sock.poll(20):
                continue
            identity, payload = sock.recv_multipart()
            msg = decoder.decode(payload)
            if isinstance(msg, p.Ping) and not self.silent:
                pong = p.Pong(sent_at=msg.sent_at, service="decode", instance=0, ready=self.ready)
                sock.send_multipart([identity, p.encode(pong)])
            elif isinstance(msg, p.DecodeRequest):
                self.requests.put(msg)
            elif isinstance(msg, p.Abort):
                self.aborts.put(msg.request_id)
        sock.close()
        ctx.term()

    def answer(self, req: p.DecodeRequest, text: str) -> None:
        self.outbox.put(
            p.TokenChunk(
                request_id=req.request_id, trace_id=req.trace_id, token_ids=[42], text=text
            )
        )
        usage = p.Usage(prompt_tokens=len(req.prompt_token_ids), completion_tokens=1)
        self.outbox.put(
            p.Finished(
                request_id=req.request_id,
                trace_id=req.trace_id,
                finish_reason="length",
                usage=usage,
            )
        )


@pytest.fixture
def scripted(tmp_path: Path, model_dir: Path) -> Iterator[tuple[DeploymentConfig, ScriptedDecode]]:
    cfg = config(model_dir, max_queued_requests=1, drain_seconds=120)
    decode = ScriptedDecode(cfg.decode_addresses[0].address)
    decode.start()
    decode.bound.wait(10)
    yield cfg, decode
    decode.stop.set()
    decode.join(5)


def post(url: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def health(url: str) -> int:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=5) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as exc:
        return exc.code


def wait_healthy(url: str, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        assert proc.poll() is None, "the router exited"
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2):
                return
        except (urllib.error.URLError, ConnectionError):
            time.sleep(0.1)
    raise AssertionError("the router never became healthy")


def test_router_admission_and_drain(
    tmp_path: Path, scripted: tuple[DeploymentConfig, ScriptedDecode], notifications: Notifications
) -> None:
    cfg, decode = scripted
    url = f"http://{cfg.host}:{cfg.http_port}"
    proc = start(tmp_path, "router", cfg, notifications, watchdog_usec=1_000_000)
    client = Client(cfg.front_address, timeout=60)
    try:
        notifications.wait_for("READY=1", proc, timeout=60)
        notifications.wait_for("WATCHDOG=1", proc, timeout=30)
        wait_healthy(url, proc)
        chunks: list[Any] = []
        stream = client.stream(prompt_token_ids=PROMPT, max_tokens=1)
        first = threading.Thread(target=lambda: chunks.extend(stream), daemon=True)
        first.start()
        held = decode.requests.get(timeout=30)  # in flight: the router's one slot is taken

        status, body = post(f"{url}/v1/completions", {"prompt": "Hi", "max_tokens": 2})
        assert status == 429, body
        assert body["error"]["code"] == "overloaded" and body["error"]["type"] == "overloaded_error"
        with pytest.raises(GenerationFailed) as refused:
            client.generate(prompt_token_ids=PROMPT, max_tokens=1)
        assert refused.value.reason == "overloaded"

        proc.send_signal(signal.SIGTERM)
        notifications.wait_for("STOPPING=1", proc, timeout=30)
        status, body = post(f"{url}/v1/completions", {"prompt": "Hi", "max_tokens": 2})
        assert status == 503 and body["error"]["code"] == "draining", body
        with pytest.raises(urllib.error.HTTPError) as health:
            urllib.request.urlopen(f"{url}/health", timeout=5)
        assert health.value.code == 503

        decode.answer(held, "done")  # the request in flight finishes during the drain
        first.join(30)
        assert "".join(c.text for c in chunks) == "done"
        assert stopped(proc) == 0
    finally:
        client.close()
        stopped(proc, 0.1)


def generate_in_background(client: Client) -> tuple[threading.Thread, list[BaseException]]:
    """A one-token generate on a thread; the list gets its GenerationFailed, if any."""
    outcome: list[BaseException] = []

    def run() -> None:
        try:
            client.generate(prompt_token_ids=PROMPT, max_tokens=1)
        except GenerationFailed as exc:
            outcome.append(exc)

    waiter = threading.Thread(target=run, daemon=True)
    waiter.start()
    return waiter, outcome


def test_router_drain_deadline_fails_and_aborts(
    tmp_path: Path, scripted: tuple[DeploymentConfig, ScriptedDecode], notifications: Notifications
) -> None:
    cfg, decode = scripted
    cfg = msgspec.structs.replace(cfg, drain_seconds=0.0)
    proc = start(tmp_path, "router", cfg, notifications)
    client = Client(cfg.front_address, timeout=60)
    try:
        notifications.wait_for("READY=1", proc, timeout=60)
        wait_healthy(f"http://{cfg.host}:{cfg.http_port}", proc)
        waiter, outcome = generate_in_background(client)
        held = decode.requests.get(timeout=30)
        proc.send_signal(signal.SIGTERM)
        waiter.join(30)
        assert len(outcome) == 1 and isinstance(outcome[0], GenerationFailed), outcome
        assert outcome[0].reason == "draining" and "drain_seconds = 0" in outcome[0].message
        assert decode.aborts.get(timeout=30) == held.request_id  # the decode is told to stop
        assert stopped(proc) == 0
    finally:
        client.close()
        stopped(proc, 0.1)


def test_router_fails_what_a_draining_instance_held_when_it_goes_silent(
    tmp_path: Path, scripted: tuple[DeploymentConfig, ScriptedDecode], notifications: Notifications
) -> None:
    cfg, decode = scripted
    proc = start(tmp_path, "router", cfg, notifications)
    client = Client(cfg.front_address, timeout=120)
    try:
        notifications.wait_for("READY=1", proc, timeout=60)
        url = f"http://{cfg.host}:{cfg.http_port}"
        wait_healthy(url, proc)
        waiter, outcome = generate_in_background(client)
        decode.requests.get(timeout=30)
        decode.ready = False  # draining: no new requests, the held one continues...
        while health(url) == 200:  # until the router has seen a Pong saying so
            time.sleep(0.1)
        decode.silent = True  # ...until the instance dies mid-drain
        waiter.join(60)
        assert len(outcome) == 1 and outcome[0].reason == "peer_down", outcome  # type: ignore[attr-defined]
    finally:
        client.close()
        proc.send_signal(signal.SIGTERM)
        stopped(proc, 30)
