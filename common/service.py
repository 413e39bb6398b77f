"""The asyncio shell shared by the prefill and decode services.

A service binds one ROUTER socket for the router, decodes each frame with its direction's
typed decoder, and dispatches by message type. Malformed frames are counted, logged and
answered, never fatal. Model work happens in the service's WorkerThread.
"""

from __future__ import annotations

import abc
import asyncio
import signal
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
import structlog
import zmq
import zmq.asyncio

from pdserve.common import protocol as p
from pdserve.common.metrics import Metrics
from pdserve.common.sockets import make_socket
from pdserve.common.worker import WorkerThread

log = structlog.get_logger("pdserve.service")

Handler = Callable[[bytes, Any], Awaitable[None] | None]


class Service(abc.ABC):
    role = "service"

    def __init__(self, instance: int, address: str, inbound: Any) -> None:
        self.instance = instance
        self.address = address
        self.metrics = Metrics(self.role, instance)
        self.ctx = zmq.asyncio.Context()
        self._decoder: p.Decoder[Any] = p.Decoder(inbound)
        self.handlers: dict[type, Handler] = {p.Ping: self.on_ping, p.MetricsQuery: self.on_metrics}
        self.worker: WorkerThread | None = None
        self.stopping = asyncio.Event()
        self.front: zmq.asyncio.Socket | None = None
        self.log = log.bind(service=self.role, instance=instance)

    # -- lifecycle ------------------------------------------------------------------------

    @abc.abstractmethod
    def make_worker(self, loop: asyncio.AbstractEventLoop) -> WorkerThread:
        """The service's engine thread (not started)."""

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self.stopping.set)
        self.front = make_socket(self.ctx, zmq.ROUTER, bind=self.address)
        await self.start_sockets()
        self.worker = self.make_worker(loop)
        self.worker.start()
        tasks = [asyncio.create_task(self._receive(self.front, self._decoder, self.handlers))]
        tasks += self.background_tasks()
        await asyncio.to_thread(self.worker.ready.wait)
        if self.worker.failed is not None:
            self.log.error("service_failed", error=str(self.worker.failed))
            raise SystemExit(f"{self.role} {self.instance}: {self.worker.failed}")
        self.log.info("service_ready", address=self.address)
        self.on_ready()
        await self.stopping.wait()
        self.log.info("service_stopping")
        self.worker.stop()
        await asyncio.to_thread(self.worker.join, 10)
        for t in tasks:
            t.cancel()
        self.ctx.destroy(linger=0)

    async def start_sockets(self) -> None:
        pass

    def background_tasks(self) -> list[asyncio.Task[None]]:
        return []

    def on_ready(self) -> None:
        pass

    @property
    def is_ready(self) -> bool:
        w = self.worker
        return w is not None and w.ready.is_set() and w.failed is None

    # -- messages -------------------------------------------------------------------------

    async def _receive(self, sock: zmq.asyncio.Socket, decoder: p.Decoder[Any], handlers: dict[type, Handler]) -> None:
        while True:
            frames = await sock.recv_multipart()
            if len(frames) != 2:
                self.metrics.inc("pdserve:bad_messages")
                self.log.warning("bad_frame_count", frames=len(frames))
                continue
            identity, payload = frames
            try:
                msg = decoder.decode(payload)
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                self.metrics.inc("pdserve:bad_messages")
                self.log.warning("bad_message", error=str(exc), size=len(payload))
                self.send(sock, identity, p.Failed(request_id="", reason="bad_request", message=f"undecodable message: {exc}"))
                continue
            try:
                result = handlers[type(msg)](identity, msg)
                if result is not None:
                    await result
            except Exception:  # one bad message must not take the service down
                self.log.exception("handler_failed", message_type=type(msg).__name__)

    def send(self, sock: zmq.asyncio.Socket | None, identity: bytes, msg: p.Message) -> None:
        if sock is None:
            return
        try:
            sock.send_multipart([identity, p.encode(msg)], flags=zmq.NOBLOCK)
        except zmq.ZMQError as exc:  # the peer is gone (ROUTER_MANDATORY) or its queue is full
            self.log.warning("send_failed", peer=identity.hex(), message_type=type(msg).__name__, error=str(exc))

    def reply(self, identity: bytes, msg: p.Message) -> None:
        self.send(self.front, identity, msg)

    def on_ping(self, identity: bytes, msg: p.Ping) -> None:
        running, waiting = self.load()
        self.reply(identity, p.Pong(
            sent_at=msg.sent_at, service=self.role, instance=self.instance, ready=self.is_ready,
            num_running=running, num_waiting=waiting,
        ))

    def load(self) -> tuple[int, int]:
        return 0, 0

    def on_metrics(self, identity: bytes, msg: p.MetricsQuery) -> None:
        self.reply(identity, p.MetricsReport(samples=self.metrics.samples()))

