"""The ZMQ front door for the client SDK: one ROUTER socket, one task per request."""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec
import structlog
import zmq
import zmq.asyncio

from pdserve.common.errors import PdserveError
from pdserve.common.runtime import protocol as p
from pdserve.common.runtime.sockets import make_socket, send_nowait
from pdserve.services.router.router import Router

log = structlog.get_logger("pdserve.router.front")


class FrontDoor:
    def __init__(self, router: Router, address: str) -> None:
        self.router = router
        self.sock: Any = make_socket(
            router.ctx, zmq.ROUTER, bind=address, curve=router.security.front
        )
        self.decoder: p.Decoder[Any] = p.Decoder(p.ClientToRouter)
        self.tasks: dict[str, asyncio.Task[None]] = {}

    async def serve(self) -> None:
        while True:
            frames = await self.sock.recv_multipart()
            if len(frames) != 2:
                self.router.metrics.inc("pdserve:bad_messages")
                log.warning("bad_frame_count", frames=len(frames))
                continue
            identity, payload = frames
            try:
                msg = self.decoder.decode(payload)
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                self.router.metrics.inc("pdserve:bad_messages")
                log.warning("bad_message", error=str(exc), size=len(payload))
                self._send(
                    identity,
                    p.Failed(
                        request_id="", reason="bad_request", message=f"undecodable message: {exc}"
                    ),
                )
                continue
            try:
                if isinstance(msg, p.Abort):
                    await self.router.abort(msg.request_id)
                else:
                    self._start(identity, msg)
            except Exception:  # one odd request must not close the front door
                log.exception("front_door_failed", request_id=msg.request_id)
                self._send(
                    identity,
                    p.Failed(
                        request_id=msg.request_id,
                        reason="internal",
                        message=(
                            f"internal error in request {msg.request_id or '?'}; the router's log has details"
                        ),
                    ),
                )

    def _start(self, identity: bytes, gen: p.Generate) -> None:
        try:
            events = self.router.submit(gen)
        except PdserveError as exc:
            self._send(
                identity,
                p.Failed(request_id=gen.request_id, reason="bad_request", message=str(exc)),
            )
            return
        task = asyncio.create_task(self._relay(identity, gen.request_id, events))
        self.tasks[gen.request_id] = task
        task.add_done_callback(lambda _: self.tasks.pop(gen.request_id, None))

    async def _relay(self, identity: bytes, request_id: str, events: Any) -> None:
        try:
            async for event in events:
                self._send(identity, event)
        except Exception:  # a bug must still end the request for the client, not hang it
            log.exception("front_door_request_failed", request_id=request_id)
            self._send(
                identity,
                p.Failed(
                    request_id=request_id,
                    reason="internal",
                    message=(
                        f"internal error in request {request_id}; the router's log has details"
                    ),
                ),
            )

    def _send(self, identity: bytes, msg: p.Message) -> None:
        rid = getattr(msg, "request_id", "")

        def failed(exc: zmq.ZMQError) -> None:
            task = self.tasks.get(rid)
            if task is not None and not task.done():  # the client is gone: stop its request
                log.warning("client_send_failed", request_id=rid, error=str(exc))
                task.cancel()  # closes the core's iterator, which aborts the request

        send_nowait(self.sock, [identity, p.encode(msg)], failed)
