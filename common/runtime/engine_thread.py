"""The bridge between a service's asyncio loop and its engine thread.

Model steps and NIXL calls block, so each service runs them in one worker thread (NIXL
agents are not thread-safe: one thread owns the agent). The loop hands commands over a
thread-safe queue; the thread hands results back with ``call_soon_threadsafe``.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import traceback
from collections.abc import Callable
from typing import Any

import structlog

from pdserve.common.runtime.sd_notify import Watchdog

log = structlog.get_logger("pdserve.worker")


def report_engine(metrics: Any, engine: Any, num_pending: int, preemptions_seen: int) -> int:
    """Set a service engine's pool and queue gauges and count new preemptions; returns the
    preemption total now seen (the scheduler counts in total, the metric in increments)."""
    sched = engine.scheduler
    metrics.set("pdserve:kv_blocks_free", engine.pool.num_free_blocks)
    metrics.set("pdserve:num_requests_running", len(sched.running))
    metrics.set("pdserve:num_requests_waiting", len(sched.waiting) + num_pending)
    if sched.num_preemptions > preemptions_seen:
        metrics.inc("pdserve:num_preemptions", sched.num_preemptions - preemptions_seen)
    replayed = sched.num_replayed_tokens - metrics.value("pdserve:prefix_cache_replayed_tokens")
    if replayed > 0:
        metrics.inc("pdserve:prefix_cache_replayed_tokens", replayed)
    return int(sched.num_preemptions)


class WorkerThread(threading.Thread):
    """Runs ``setup()`` once, then ``run_once(commands)`` until stopped.

    ``run_once`` gets the commands that arrived since the last call; when the worker
    reports itself idle, the thread waits up to ``idle_wait`` for the next command.
    Every turn kicks the systemd watchdog (when the service set one): a model step that
    hangs stops the pings. Commands are ``(kind, *args)`` tuples that subclasses
    dispatch to ``_on_<kind>``; ``("barrier", event)`` is understood by every worker.
    """

    idle_wait = 0.005

    def __init__(self, loop: asyncio.AbstractEventLoop, name: str) -> None:
        super().__init__(name=name, daemon=True)
        self.loop = loop
        self.inbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.ready = threading.Event()
        self.failed: BaseException | None = None
        self._stop_event = threading.Event()
        self.watchdog: Watchdog | None = None
        # Called on the service's loop when run_once raised: the engine cannot go on.
        self.on_fatal: Callable[[BaseException], None] | None = None

    def submit(self, command: Any) -> None:
        self.inbox.put(command)

    def stop(self) -> None:
        self._stop_event.set()
        self.inbox.put(None)

    def post(self, callback: Callable[..., Any], *args: Any) -> None:
        """Run ``callback(*args)`` on the service's loop."""
        if not self.loop.is_closed():
            self.loop.call_soon_threadsafe(callback, *args)

    def setup(self) -> None:  # pragma: no cover - overridden
        pass

    def run_once(self, commands: list[Any]) -> bool:  # pragma: no cover - overridden
        """Handle commands, do one unit of work; True when there is more work pending."""
        return False

    def teardown(self) -> None:
        pass

    def _on_barrier(self, done: threading.Event) -> None:
        """Set ``done``: every command submitted before it has been handled."""
        done.set()

    def run(self) -> None:
        try:
            self.setup()
        except BaseException as exc:  # reported to the service, which exits with it
            self.failed = exc
            log.error(
                "worker_setup_failed",
                worker=self.name,
                error=str(exc),
                traceback=traceback.format_exc(),
            )
            self.ready.set()
            return
        self.ready.set()
        busy = False
        try:
            while not self._stop_event.is_set():
                if self.watchdog is not None:
                    self.watchdog.kick()
                commands = self._drain(block=not busy)
                if self._stop_event.is_set():
                    break
                busy = self.run_once(commands)
        except Exception as exc:  # noqa: BLE001 - a dead engine thread must not look alive
            self.failed = exc
            log.error(
                "worker_failed", worker=self.name, error=str(exc), traceback=traceback.format_exc()
            )
            if self.on_fatal is not None:
                self.post(self.on_fatal, exc)
        finally:
            self.teardown()

    def _drain(self, block: bool) -> list[Any]:
        commands: list[Any] = []
        if block:
            try:
                commands.append(self.inbox.get(timeout=self.idle_wait))
            except queue.Empty:
                return commands
        while True:
            try:
                commands.append(self.inbox.get_nowait())
            except queue.Empty:
                break
        return [c for c in commands if c is not None]
