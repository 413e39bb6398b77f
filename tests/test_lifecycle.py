"""A service's life under systemd, on real processes: READY, WATCHDOG, STOPPING through
a real $NOTIFY_SOCKET; admission (Failed "overloaded"), and the drain on SIGTERM.

The decode service runs alone (colocated: it computes prompts itself), driven by a
DEALER standing in for the router (the router's life: tests/test_lifecycle_router.py).
"""

from __future__ import annotations

import signal
import time
from pathlib import Path
from typing import Any

import pytest
import zmq

from pdserve.common.engine.sampling_params import SamplingParams
from pdserve.common.runtime import protocol as p
from tests.lifecycle_tools import (  # noqa: F401 (notifications_fixture: a fixture)
    PROMPT,
    Notifications,
    config,
    notifications_fixture,
    start,
    stopped,
)

pytestmark = pytest.mark.slow


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
