"""The ZMQ front door for the client SDK: one ROUTER socket, one task per request."""

from __future__ import annotations

import asyncio
import functools
from typing import Any

import msgspec
import structlog
import zmq
import zmq.asyncio

from pdserve.common.errors import PdserveError, RequestError
from pdserve.common.runtime import protocol as p
from pdserve.common.runtime.log_throttle import LogThrottle
from pdserve.common.runtime.sockets import make_socket, send_nowait
from pdserve.services.router.core_api import Refused
from pdserve.services.router.router import MAX_LABEL_CHARS, Router
from pdserve.services.router.tokenize_pool import TokenizePool

log = structlog.get_logger("pdserve.router.front")


LONG_TEXT_CHARS = 16_384  # tokenise longer prompts in the pool, off the loop's GIL


def _sdk_prompt(core: Any, gen: p.Generate) -> list[int]:
    """A Generate's text or chat as token ids (in a tokenize-pool worker)."""
    if gen.messages is not None:
        return list(core.tokenizer.encode_chat([{"role": m.role, "content": m.content}
                                                for m in gen.messages]))  # fmt: skip
    assert gen.prompt is not None
    return list(core.tokenizer.encode(gen.prompt))


class FrontDoor:
    def __init__(self, router: Router, address: str, pool: TokenizePool | None = None) -> None:
        self.router = router
        self.pool = pool
        self.sock: Any = make_socket(
            router.ctx, zmq.ROUTER, bind=address, curve=router.security.front
        )
        self.decoder: p.Decoder[Any] = p.Decoder(p.ClientToRouter)
        self.tasks: dict[tuple[bytes, str], asyncio.Task[None]] = {}  # (client, its id)
        self.preparing: dict[tuple[bytes, str], asyncio.Task[None]] = {}  # being tokenised
        self.throttle = LogThrottle()  # a lost client, a flood of bad frames: few lines

    async def serve(self) -> None:
        while True:
            frames = await self.sock.recv_multipart()
            if len(frames) != 2:
                self.router.metrics.inc("pdserve:bad_messages")
                if (suppressed := self.throttle.allow("bad_frame_count")) is not None:
                    log.warning("bad_frame_count", frames=len(frames), suppressed=suppressed)
                continue
            identity, payload = frames
            try:
                msg = self.decoder.decode(payload)
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                self.router.metrics.inc("pdserve:bad_messages")
                if (suppressed := self.throttle.allow("bad_message")) is not None:
                    log.warning("bad_message", error=str(exc), size=len(payload),
                                suppressed=suppressed)  # fmt: skip
                self._send(
                    identity,
                    p.Failed(
                        request_id="", reason="bad_request", message=f"undecodable message: {exc}"
                    ),
                )
                continue
            try:
                if isinstance(msg, p.Abort):  # only this connection's own request
                    preparing = self.preparing.pop((identity, msg.request_id), None)
                    if preparing is not None:  # still tokenising: it never starts
                        preparing.cancel()
                    await self.router.abort(msg.request_id, owner=identity.hex())
                elif msg.request_id and (identity, msg.request_id) in self.tasks:  # still runs
                    self._send(identity, p.Failed(
                        request_id=msg.request_id, reason="bad_request",
                        message=f"request id {msg.request_id!r} is already in use by this client",
                    ))  # fmt: skip
                elif self.pool is not None and self._is_long(msg):
                    key = (identity, msg.request_id)
                    task = asyncio.create_task(self._tokenize_then_start(identity, msg))
                    self.tasks[key] = self.preparing[key] = task
                    task.add_done_callback(functools.partial(self._forget, key))
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

    def _is_long(self, gen: p.Generate) -> bool:
        if gen.prompt is not None:
            return len(gen.prompt) > LONG_TEXT_CHARS
        return gen.messages is not None and (
            sum(len(m.content) for m in gen.messages) > LONG_TEXT_CHARS
        )

    def _forget(self, key: tuple[bytes, str], task: asyncio.Task[None]) -> None:
        if self.tasks.get(key) is task:
            del self.tasks[key]
        if self.preparing.get(key) is task:
            del self.preparing[key]

    async def _tokenize_then_start(self, identity: bytes, gen: p.Generate) -> None:
        """A long prompt: refused untokenised when it cannot fit, else tokenised in the
        pool; then started as any other."""
        assert self.pool is not None
        try:
            if sum(x is not None for x in (gen.prompt, gen.messages, gen.prompt_token_ids)) != 1:
                raise RequestError("give exactly one of prompt, prompt_token_ids or messages")
            self.router.check_chars(
                len(gen.prompt) if gen.prompt is not None
                else sum(len(m.content) + len(m.role) for m in gen.messages or [])
            )  # fmt: skip
            ids = await self.pool.run(_sdk_prompt, gen)
        except PdserveError as exc:  # a bad prompt, or the pool's deadline or bound (Refused)
            self._refuse(identity, gen, exc)
            return
        self.preparing.pop((identity, gen.request_id), None)
        gen = msgspec.structs.replace(gen, prompt=None, messages=None, prompt_token_ids=ids)
        self._start(identity, gen)

    def _start(self, identity: bytes, gen: p.Generate) -> None:
        try:
            events = self.router.submit(gen, owner=identity.hex())
        except PdserveError as exc:
            self._refuse(identity, gen, exc)
            return
        key = (identity, gen.request_id)
        task = asyncio.create_task(self._relay(identity, gen.request_id, events))
        self.tasks[key] = task
        task.add_done_callback(functools.partial(self._forget, key))

    def _refuse(self, identity: bytes, gen: p.Generate, exc: PdserveError) -> None:
        rid = gen.request_id if len(gen.request_id) <= MAX_LABEL_CHARS else ""
        reason = exc.reason if isinstance(exc, Refused) else "bad_request"
        self._send(identity, p.Failed(request_id=rid, reason=reason, message=str(exc)))

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
            task = self.tasks.get((identity, rid))
            # The client is gone: stop its request. Chunks already queued fail too, before
            # the cancellation lands: one line per client and interval, not per token.
            if task is not None and not task.done() and not task.cancelling():
                suppressed = self.throttle.allow(("client_send_failed", identity))
                if suppressed is not None:
                    log.warning("client_send_failed", request_id=rid, error=str(exc),
                                suppressed=suppressed)  # fmt: skip
                task.cancel()  # closes the core's iterator, which aborts the request

        send_nowait(self.sock, [identity, p.encode(msg)], failed)
