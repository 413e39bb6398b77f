"""The router's life under systemd, on a real process: READY, WATCHDOG, STOPPING,
admission and the drain on SIGTERM, in front of a scripted decode: a ROUTER socket in this
test, so what is in flight when is decided here, not by timing (the services' life:
tests/test_lifecycle.py).
"""

from __future__ import annotations

import json
import queue
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq

from pdserve.common.runtime import protocol as p
from pdserve.common.runtime.service_config import DeploymentConfig
from pdserve.services.router.client import Client, GenerationFailed
from tests.lifecycle_tools import (  # noqa: F401 (notifications_fixture: a fixture)
    PROMPT,
    Notifications,
    config,
    notifications_fixture,
    start,
    stopped,
)

pytestmark = pytest.mark.slow


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
