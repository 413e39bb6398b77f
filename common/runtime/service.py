"""The asyncio shell shared by the prefill and decode services.

A service binds one ROUTER socket for the router, decodes each frame with its direction's
typed decoder, and dispatches by message type. Malformed frames are counted, logged and
answered, never fatal. Model work happens in the service's EngineThread.

Lifecycle (systemd ``Type=notify``, see common/runtime/sd_notify.py): READY=1 once the
engine thread loaded the weights and the sockets are bound; WATCHDOG=1 from the engine
thread's loop while the asyncio loop also turns. SIGTERM drains: new requests are refused with Failed
"draining" (and Pongs say not ready, so the router stops picking this instance), work in
flight gets ``drain_seconds`` to finish, what is left then ends with Failed "draining";
the process exits 0. A second SIGTERM or SIGINT cuts the drain short.

Admission: at most ``max_queued_requests`` requests in flight (accepted, no terminal
reply yet); beyond that a request is refused at once with Failed "overloaded", so a
flood costs a reply each, never memory. The messages (decoding, admission, replies) are
common/runtime/service_messages.py's.
"""

from __future__ import annotations

import abc
import asyncio
import multiprocessing
import os
import signal
import threading
import time
from typing import Any

import zmq

from pdserve.common.runtime import protocol as p
from pdserve.common.runtime.engine_commands import Abort, Barrier
from pdserve.common.runtime.engine_thread import EngineContext, EngineThread
from pdserve.common.runtime.fault_hooks import FaultHooks
from pdserve.common.runtime.loop_lag import LoopLag
from pdserve.common.runtime.sd_notify import Watchdog, notify
from pdserve.common.runtime.service_config import DeploymentConfig
from pdserve.common.runtime.service_messages import ServiceMessages
from pdserve.common.runtime.sockets import make_socket

FLUSH_SECONDS = 0.5  # after a fatal failure, for the Failed replies to leave before exit


class Service(ServiceMessages, abc.ABC):
    """A role's service: the front ROUTER's messages (``ServiceMessages``), its engine
    thread's lifecycle (load, serve, drain, stop) and its faults (a router lost, the
    engine thread dead)."""

    def __init__(self, cfg: DeploymentConfig, instance: int, address: str, inbound: Any) -> None:
        super().__init__(cfg, instance, address, inbound)
        self.stopping = asyncio.Event()
        self.stop_now = asyncio.Event()  # a second signal: end the drain at once
        self.watchdog = Watchdog.from_env(needs_loop=True)
        self.exit_error: str | None = None  # set when the engine thread died: exit non-zero

    # -- lifecycle ------------------------------------------------------------------------

    @abc.abstractmethod
    def make_engine_thread(self, loop: asyncio.AbstractEventLoop) -> EngineThread:
        """The service's engine thread (not started)."""

    def engine_context(self, torch_threads: int) -> EngineContext:
        return EngineContext(
            cfg=self.cfg,
            instance=self.instance,
            torch_threads=torch_threads,
            metrics=self.metrics,
            reply=self.reply,
            faults=FaultHooks.from_env(),
        )

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self._on_signal)
        notify(f"STATUS=loading the model ({self.role} {self.instance})")
        bind = self.cfg.addresses_of(self.role)[self.instance].bound(self.address)
        self.front = make_socket(self.ctx, zmq.ROUTER, bind=bind, curve=self.security.server)
        await self.start_sockets()
        engine = self.engine_thread = self.make_engine_thread(loop)
        engine.watchdog = self.watchdog
        engine.on_fatal = self.on_engine_failed
        engine.start()
        tasks = [asyncio.create_task(self._receive(self.front, self._decoder, self.handlers))]
        tasks += self.background_tasks()
        tasks.append(asyncio.create_task(self._watch_routers()))
        if self.watchdog is not None:
            tasks.append(asyncio.create_task(self._loop_ticks(self.watchdog)))
        while not engine.ready.is_set():
            if self.stopping.is_set():  # stopped while loading: nothing to drain
                self.log.info("service_stopped_while_loading")
                self.ctx.destroy(linger=0)
                for child in multiprocessing.active_children():  # rank processes, if started
                    child.terminate()
                # The engine thread is inside torch/NIXL set-up and cannot be stopped;
                # the interpreter's exit would abort on its native threads.
                os._exit(0)
            await asyncio.to_thread(engine.ready.wait, 0.2)
        if engine.failed is not None:
            self.log.error("service_failed", error=str(engine.failed))
            notify(f"STATUS=failed: {engine.failed}")
            raise SystemExit(f"{self.role} {self.instance}: {engine.failed}")
        self.log.info("service_ready", address=self.address)
        notify("READY=1", f"STATUS={self.role} {self.instance} serving at {self.address}")
        await self.stopping.wait()
        await self.drain()
        self.log.info("service_stopping")
        engine.stop()
        await asyncio.to_thread(engine.join, 10)
        for t in tasks:
            t.cancel()
        self.ctx.destroy(linger=0)
        if self.exit_error is not None:
            raise SystemExit(self.exit_error)

    def _on_signal(self) -> None:
        if self.stopping.is_set():
            self.stop_now.set()
        self.stopping.set()

    async def _loop_ticks(self, watchdog: Watchdog) -> None:
        while True:
            watchdog.loop_tick()
            await asyncio.sleep(watchdog.interval / 2)

    async def drain(self) -> None:
        """Refuse new requests, give those in flight ``drain_seconds``, fail the rest."""
        self.draining = True
        seconds = self.cfg.drain_seconds
        self.log.info(
            "service_draining",
            num_requests=len(self.inflight),
            num_busy=self.num_busy(),
            drain_seconds=seconds,
        )
        notify("STOPPING=1", f"STATUS=draining {self.num_busy()} requests (at most {seconds:g} s)")
        deadline = asyncio.get_running_loop().time() + seconds
        while self.num_busy() and not self.stop_now.is_set():
            remaining = deadline - asyncio.get_running_loop().time()
            if remaining <= 0:
                break
            try:  # poll: requests end on the engine thread's schedule
                await asyncio.wait_for(self.stop_now.wait(), min(0.05, remaining))
            except TimeoutError:
                pass
        engine = self.engine_thread
        if not self.inflight or engine is None:
            return
        self.log.warning("drain_timeout", request_ids=list(self.inflight), drain_seconds=seconds)
        for rid, (identity, trace) in list(self.inflight.items()):
            self.reply(
                identity,
                p.Failed(
                    request_id=rid,
                    trace_id=trace,
                    reason="draining",
                    message=(
                        f"{self.role} {self.instance} shut down before the request finished: it drains for "
                        f"at most drain_seconds = {seconds:g} s; retry the request"
                    ),
                ),
            )
            engine.submit(Abort(request_id=rid))
        # Let the engine thread act on the aborts (release producers' KV) before it stops.
        done = threading.Event()
        engine.submit(Barrier(done=done))
        await asyncio.to_thread(done.wait, 5.0)
        await asyncio.sleep(0)  # and the loop send what the engine thread posted

    def num_busy(self) -> int:
        """What the drain waits for: requests in flight (prefill adds pinned KV leases)."""
        return len(self.inflight)

    async def start_sockets(self) -> None:  # noqa: B027 (an optional hook, empty by default)
        """Bind the role's sockets besides the front ROUTER (prefill: its side channel)."""

    def background_tasks(self) -> list[asyncio.Task[None]]:
        return []

    # -- faults ---------------------------------------------------------------------------

    async def _watch_routers(self) -> None:
        """A router that stopped pinging (it died, or its connection did) will never read
        its requests' replies: abort them, so their KV is freed now, not stranded."""
        lag = LoopLag(self.cfg.ping_seconds, self.metrics)
        while True:
            await asyncio.sleep(self.cfg.ping_seconds)
            now = time.monotonic()
            stalled = lag.tick()
            for identity, last in list(self.routers.items()):
                if stalled:  # this loop's stall, not the router's silence
                    last = self.routers[identity] = last + stalled
                if now - last >= self.cfg.peer_timeout_seconds:
                    del self.routers[identity]
                    self.on_router_lost(identity)

    def on_peer_unreachable(self, identity: bytes) -> None:
        """A reply to this router found its connection gone (it dropped ours while this
        process was stopped or partitioned from it, and reconnected as a new peer, or not at
        all): no reply of its requests can reach it, and it has failed them already
        (peer_down). Abort them now rather than generate to the end for nobody."""
        if any(who == identity for who, _ in self.inflight.values()):
            self.routers.pop(identity, None)
            self.on_router_lost(identity, why="its connection to this service is gone")

    def on_router_lost(self, identity: bytes, why: str = "") -> None:
        rids = [rid for rid, (who, _) in self.inflight.items() if who == identity]
        why = why or (
            f"heard no ping from this router for {self.cfg.peer_timeout_seconds:g} s "
            "(peer_timeout_seconds)"
        )
        self.metrics.inc("pdserve:router_lost")
        self.log.warning(
            "router_lost", router=identity.hex(), num_aborted=len(rids), request_ids=rids[:16],
            why=why,
        )  # fmt: skip
        message = f"{self.role} {self.instance} {why} and aborted the request; retry it"
        for rid in rids:
            _, trace = self.inflight.pop(rid)
            if self.engine_thread is not None:
                self.engine_thread.submit(Abort(request_id=rid))
            # Lost to us, maybe not gone: a router that was only stalled learns why at once.
            failed = p.Failed(request_id=rid, trace_id=trace, reason="peer_down", message=message)
            self.send(self.front, identity, failed)

    def on_engine_failed(self, exc: BaseException) -> None:
        """The engine thread died (a rank process died, a step raised): fail every request
        in flight now, answer pings as not ready, and exit non-zero (after a moment for
        the replies to leave) so that the supervisor restarts the service."""
        why = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        self.exit_error = f"{self.role} {self.instance} failed: {why}"
        self.log.error("service_failed", error=why, num_failed=len(self.inflight))
        notify(f"STATUS=failed: {why}")
        message = f"{self.role} {self.instance} failed ({why}); it restarts; retry the request"
        for rid, (identity, trace) in list(self.inflight.items()):
            self.reply(
                identity,
                p.Failed(request_id=rid, trace_id=trace, reason="peer_down", message=message),
            )
        self.inflight.clear()
        self.stop_now.set()  # nothing to drain: the engine is gone
        asyncio.get_running_loop().call_later(FLUSH_SECONDS, self.stopping.set)
