"""The ZMQ client SDK: generate text from Python over the router's front door.

    with Client() as client:  # the address `pdserve up` binds: tcp://127.0.0.1:5600
        print(client.generate("The capital of France is", max_tokens=8).text)
        for chunk in client.stream(messages=[{"role": "user", "content": "Hi"}]):
            print(chunk.text, end="")

    async with AsyncClient() as client:
        result = await client.generate(prompt_token_ids=[1, 2, 3], temperature=0.7)
        async for chunk in client.stream("Once upon a time"):
            ...

One DEALER socket per client carries every request, multiplexed by ``request_id``: the
SDK names each request (``sdk-<uuid4 hex>`` unless the caller passes ``request_id``) and
routes reply frames by it. Frames are single msgpack messages (protocol.encode), no
empty delimiter. A request ends with exactly one Finished (a Result) or Failed (raised
as GenerationFailed). A stream left early, or a request past its ``timeout``, sends an
Abort so the router frees its resources. ``timeout`` (per client or per call) bounds a
whole request, DEFAULT_TIMEOUT_S unless given (None: no bound; generation can take
minutes). A router that cannot be reached is not waited for that long: a request fails
with reason ``unreachable`` once the socket has had no connection to the router for
``connect_timeout`` seconds while it waited (at start, or after the router went away).

A router with CURVE on (docs/operations.md) needs ``curve=CurveKeys.client(keys_dir,
name)``. A handshake the router refuses (unknown key, no CURVE, wrong server key) fails
every pending and later request at once with GenerationFailed, reason
``unauthenticated``: libzmq does not retry such a handshake, so waiting would be forever.
"""

from __future__ import annotations

import asyncio
import re
import threading
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import suppress
from dataclasses import dataclass
from typing import Any, Self, TypeAlias, TypeVar

import msgspec
import structlog
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from pdserve.common.engine.sampling_params import SamplingParams, TokenLogprobs
from pdserve.common.errors import PdserveError, RequestError
from pdserve.common.runtime.curve import CurveKeys, describe_failure
from pdserve.common.runtime.protocol import (
    Abort,
    ChatMessage,
    Decoder,
    Failed,
    Finished,
    Generate,
    RouterToClient,
    TokenChunk,
    Usage,
    encode,
)
from pdserve.common.runtime.sockets import HEARTBEAT_TIMEOUT_MS, make_socket

log = structlog.get_logger("pdserve.client")

DEFAULT_ADDRESS = "tcp://127.0.0.1:5600"  # DeploymentConfig's front_address by default
DEFAULT_TIMEOUT_S = 600.0
DEFAULT_CONNECT_TIMEOUT_S = 10.0
ABORT_FLUSH_MS = 1_000  # close() waits this long at most for queued aborts to leave
_SANE_ID = re.compile(r"[\x21-\x7e]{1,128}")  # the HTTP API's x-request-id rule
HWM = 100_000  # per-token frames of many concurrent streams; queued, not dropped
POLL_SLICE_S = 0.05  # the sync client releases the socket this often for other threads
REACHABLE_CHECK_S = 0.25  # the async client checks the router's connection this often
Event: TypeAlias = TokenChunk | Finished | Failed
_S = TypeVar("_S", bound=zmq.Socket[Any])  # a sync or an asyncio socket
_HANDSHAKE_EVENTS = (
    zmq.EVENT_HANDSHAKE_SUCCEEDED
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
    | zmq.EVENT_DISCONNECTED
)
_UNSET: Any = object()  # a timeout argument not given (None means "no bound")


class GenerationFailed(PdserveError):
    """The router answered Failed: ``reason`` is its short code, ``message`` says why."""

    def __init__(self, reason: str, message: str, request_id: str = "") -> None:
        super().__init__(f"request {request_id or '?'} failed ({reason}): {message}")
        self.reason = reason
        self.message = message
        self.request_id = request_id


class GenerationTimeout(GenerationFailed, TimeoutError):
    def __init__(self, request_id: str, timeout: float) -> None:
        super().__init__("timeout", f"no answer within {timeout} s; the request was aborted",
                         request_id)  # fmt: skip


@dataclass(frozen=True)
class Result:
    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str  # stop | length | abort
    usage: Usage
    logprobs: list[TokenLogprobs]  # one per token, when asked for (logprobs=N)
    # prompt_logprobs=N: entry i is prompt token i + 1's (the first token has none)
    prompt_logprobs: list[TokenLogprobs] | None = None


def _dealer(ctx: zmq.Context[_S], address: str, curve: CurveKeys | None) -> _S:
    """The client's one socket, from the project's socket factory."""
    return make_socket(ctx, zmq.DEALER, connect=address, hwm=HWM, curve=curve,
                       monitor_events=_HANDSHAKE_EVENTS)  # fmt: skip


def _request(
    prompt: str | None,
    prompt_token_ids: Sequence[int] | None,
    messages: Sequence[ChatMessage | dict[str, str]] | None,
    request_id: str | None,
    stream: bool,
    sampling: dict[str, Any],
) -> Generate:
    if sum(x is not None for x in (prompt, prompt_token_ids, messages)) != 1:
        raise RequestError("pass exactly one of prompt, prompt_token_ids or messages")
    unknown = set(sampling) - set(SamplingParams.__struct_fields__)
    if unknown:  # msgspec would ignore them; a typo must not silently change nothing
        known = ", ".join(SamplingParams.__struct_fields__)
        raise RequestError(f"unknown sampling parameter(s) {sorted(unknown)}; known: {known}")
    if isinstance(sampling.get("stop"), str):
        sampling["stop"] = (sampling["stop"],)
    try:
        params = msgspec.convert(sampling, SamplingParams)
        chat = None if messages is None else [
            m if isinstance(m, ChatMessage) else msgspec.convert(m, ChatMessage) for m in messages
        ]  # fmt: skip
    except msgspec.ValidationError as exc:
        raise RequestError(f"bad request argument: {exc}") from None
    params.validate()  # fail here, not after a round trip
    if request_id is not None and not _SANE_ID.fullmatch(request_id):
        raise RequestError(  # the HTTP API's rule for x-request-id
            "request_id must be 1-128 printable ASCII characters without spaces, "
            f"got {request_id[:40]!r}{'...' if len(request_id) > 40 else ''}"
        )
    if prompt_token_ids is not None:
        if not prompt_token_ids:
            raise RequestError("prompt_token_ids is empty")
        bad = next((t for t in prompt_token_ids if not isinstance(t, int) or t < 0), None)
        if bad is not None:
            raise RequestError(f"prompt_token_ids holds {bad!r}: token ids are ints >= 0")
    if prompt is not None and not prompt:
        raise RequestError("the prompt is empty")
    return Generate(
        request_id=request_id or f"sdk-{uuid.uuid4().hex}",
        prompt=prompt,
        prompt_token_ids=None if prompt_token_ids is None else list(prompt_token_ids),
        messages=chat,
        sampling=params,
        stream=stream,
    )


def _result(request_id: str, chunks: list[TokenChunk], finished: Finished) -> Result:
    return Result(
        request_id=request_id,
        text="".join(c.text for c in chunks),
        token_ids=[t for c in chunks for t in c.token_ids],
        finish_reason=finished.finish_reason,
        usage=finished.usage,
        logprobs=[lp for c in chunks for lp in c.logprobs],
        prompt_logprobs=next((c.prompt_logprobs for c in chunks if c.prompt_logprobs), None),
    )


def _failed(event: Failed) -> GenerationFailed:
    return GenerationFailed(event.reason, event.message, event.request_id)


def _deadline(timeout: float | None) -> float | None:
    return None if timeout is None else time.monotonic() + timeout


def _put(queue: Any, event: Event) -> None:
    if isinstance(queue, deque):
        queue.append(event)
    else:
        queue.put_nowait(event)


class _Handshakes:
    """The outcome of the socket's handshakes with the router (its monitor's events). A
    refused one fails every pending request and, until a later handshake succeeds,
    every new one."""

    def __init__(self, sock: zmq.Socket[Any], address: str, curve: CurveKeys | None,
                 connect_timeout: float) -> None:  # fmt: skip
        # attached by make_socket, before connecting; a sync or an asyncio socket, as ``sock``
        self.monitor: Any = sock.get_monitor_socket()
        self.address = address
        self.has_curve = curve is not None
        self.refused: str | None = None
        self.connect_timeout = connect_timeout
        self.started = time.monotonic()
        self.down_since: float | None = self.started  # None: connected to the router

    def route(self, frames: list[bytes], queues: dict[str, Any]) -> None:
        event = parse_monitor_message(frames)["event"]  # from libzmq itself
        if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            self.refused = None
            self.down_since = None
            return
        if event == zmq.EVENT_DISCONNECTED:
            was_connected = self.down_since is None
            self.down_since = time.monotonic()
            if not was_connected:  # a handshake that failed: nothing was sent on it
                return
            # The router answers a connection, not a client: after a reconnect the replies
            # of requests sent before it go nowhere. Fail them now (ZMTP heartbeats bound
            # how long a router that died or froze takes to be noticed), never hang.
            lost = (f"the connection to the router at {self.address} dropped (the router went "
                    f"away, or stopped answering heartbeats for {HEARTBEAT_TIMEOUT_MS / 1000:g} "
                    "s): this request's replies cannot reach this client; retry it")  # fmt: skip
            if queues:
                log.warning("client_connection_lost", address=self.address, num_failed=len(queues))
            for rid, queue in queues.items():
                _put(queue, Failed(request_id=rid, reason="unreachable", message=lost))
            return
        if event == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL and not self.has_curve:
            return  # without CURVE: a transient failure (a peer gone mid-handshake); retried
        self.refused = (f"the router at {self.address} refused the connection: "
                        f"{describe_failure(event)}; check the CURVE keys (docs/operations.md)"
                        " and make a new client")  # fmt: skip
        log.warning(
            "client_handshake_failed", address=self.address, zmq_event=zmq.Event(event).name
        )
        for rid, queue in queues.items():
            _put(queue, Failed(request_id=rid, reason="unauthenticated", message=self.refused))

    def check(self, request_id: str) -> None:
        if self.refused is not None:
            raise GenerationFailed("unauthenticated", self.refused, request_id)

    def check_reachable(self, request_id: str, waiting_since: float) -> None:
        """Fail a request that has waited ``connect_timeout`` with no connection."""
        if self.down_since is None:
            return
        if time.monotonic() - max(self.down_since, waiting_since) < self.connect_timeout:
            return
        never = "no router answers" if self.down_since == self.started else "the router went away"
        raise GenerationFailed(
            "unreachable",
            f"{never} at {self.address} (no connection for {self.connect_timeout:g} s); is "
            "`pdserve up` running there? It prints its ZMQ SDK address when ready",
            request_id,
        )

    def close(self, sock: zmq.Socket[Any]) -> None:
        if not sock.closed:
            sock.disable_monitor()
        self.monitor.close()


class _Inbox:
    """Reply frames -> per-request queues. A frame for no pending request (late tokens of
    an aborted one) is dropped. A Failed with no request id is the router refusing a
    frame it could not decode (version skew): every pending request gets it, since one of
    them caused it and hanging would be worse than failing."""

    def __init__(self) -> None:
        self.decoder: Decoder[Event] = Decoder(RouterToClient)

    def route(self, frames: list[bytes], queues: dict[str, Any]) -> None:
        try:
            event = self.decoder.decode(frames[-1])
        except msgspec.DecodeError as exc:
            log.warning("client_bad_frame", error=str(exc), size=len(frames[-1]))
            return
        if isinstance(event, Failed) and not event.request_id:
            targets = list(queues.values())
        else:
            targets = [queues[event.request_id]] if event.request_id in queues else []
        for queue in targets:
            _put(queue, event)


class Client:
    """Blocking client; safe to share between threads (one socket, guarded by a lock)."""

    def __init__(self, address: str = DEFAULT_ADDRESS, *,
                 timeout: float | None = DEFAULT_TIMEOUT_S,
                 connect_timeout: float = DEFAULT_CONNECT_TIMEOUT_S,
                 ctx: zmq.Context[Any] | None = None,
                 curve: CurveKeys | None = None) -> None:  # fmt: skip
        self.address = address
        self.timeout = timeout
        self._sock = _dealer(ctx or zmq.Context.instance(), address, curve)
        self._handshakes = _Handshakes(self._sock, address, curve, connect_timeout)
        self._poller = zmq.Poller()
        self._poller.register(self._sock, zmq.POLLIN)
        self._poller.register(self._handshakes.monitor, zmq.POLLIN)
        self._lock = threading.Lock()
        self._queues: dict[str, deque[Event]] = {}
        self._inbox = _Inbox()

    def generate(self, prompt: str | None = None, *, prompt_token_ids: Sequence[int] | None = None,
                 messages: Sequence[ChatMessage | dict[str, str]] | None = None,
                 request_id: str | None = None, timeout: float | None = _UNSET,
                 **sampling: Any) -> Result:  # fmt: skip
        """Generate to the end; ``sampling`` are SamplingParams fields (max_tokens, ...)."""
        gen = _request(prompt, prompt_token_ids, messages, request_id, False, sampling)
        chunks: list[TokenChunk] = []
        for event in self._events(gen, timeout):
            if isinstance(event, TokenChunk):
                chunks.append(event)
            else:
                return _result(gen.request_id, chunks, event)
        raise AssertionError("unreachable: _events ends with Finished or raises")

    def stream(self, prompt: str | None = None, *, prompt_token_ids: Sequence[int] | None = None,
               messages: Sequence[ChatMessage | dict[str, str]] | None = None,
               request_id: str | None = None, timeout: float | None = _UNSET,
               **sampling: Any) -> Iterator[TokenChunk]:  # fmt: skip
        """TokenChunks as they come; breaking out of the loop aborts the request."""
        gen = _request(prompt, prompt_token_ids, messages, request_id, True, sampling)
        for event in self._events(gen, timeout):
            if isinstance(event, TokenChunk):
                yield event

    def abort(self, request_id: str) -> None:
        self._send(Abort(request_id=request_id))

    def _events(self, gen: Generate, timeout: float | None) -> Iterator[TokenChunk | Finished]:
        rid = gen.request_id
        timeout = self.timeout if timeout is _UNSET else timeout
        deadline = _deadline(timeout)
        waiting_since = time.monotonic()
        queue: deque[Event] = deque()
        self._handshakes.check(rid)
        self._queues[rid] = queue
        ended = False
        try:
            self._send(gen)
            while not ended:
                event = self._next(queue, rid, deadline, timeout, waiting_since)
                ended = isinstance(event, (Finished, Failed))
                if isinstance(event, Failed):
                    raise _failed(event)
                yield event
        finally:
            self._queues.pop(rid, None)
            if not ended:  # left early, timed out, or interrupted: the router must know
                self._send(Abort(request_id=rid))

    def _next(self, queue: deque[Event], rid: str, deadline: float | None,
              timeout: float | None, waiting_since: float) -> Event:  # fmt: skip
        while not queue:
            self._handshakes.check_reachable(rid, waiting_since)
            wait = POLL_SLICE_S
            if deadline is not None:
                wait = min(wait, deadline - time.monotonic())
                if wait <= 0:
                    raise GenerationTimeout(rid, timeout or 0.0)
            with self._lock:
                ready = dict(self._poller.poll(int(wait * 1000) + 1)) if not queue else {}
                if self._handshakes.monitor in ready:
                    self._handshakes.route(self._handshakes.monitor.recv_multipart(), self._queues)
                if self._sock in ready:
                    self._inbox.route(self._sock.recv_multipart(), self._queues)
        return queue.popleft()

    def _send(self, msg: Generate | Abort) -> None:
        with self._lock:
            self._sock.send(encode(msg))

    def close(self) -> None:
        """Close the socket; aborts already sent still leave (at most ABORT_FLUSH_MS)."""
        self._handshakes.close(self._sock)
        self._sock.close(linger=ABORT_FLUSH_MS)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncClient:
    """asyncio client: one receive task routes reply frames to per-request queues."""

    def __init__(self, address: str = DEFAULT_ADDRESS, *,
                 timeout: float | None = DEFAULT_TIMEOUT_S,
                 connect_timeout: float = DEFAULT_CONNECT_TIMEOUT_S,
                 ctx: zmq.asyncio.Context | None = None,
                 curve: CurveKeys | None = None) -> None:  # fmt: skip
        self.address = address
        self.timeout = timeout
        self._sock = _dealer(ctx or zmq.asyncio.Context.instance(), address, curve)
        self._handshakes = _Handshakes(self._sock, address, curve, connect_timeout)
        self._queues: dict[str, asyncio.Queue[Event]] = {}
        self._inbox = _Inbox()
        self._receiver: asyncio.Task[None] | None = None
        self._background: set[asyncio.Task[None]] = set()  # fire-and-forget aborts

    async def generate(self, prompt: str | None = None, *,
                       prompt_token_ids: Sequence[int] | None = None,
                       messages: Sequence[ChatMessage | dict[str, str]] | None = None,
                       request_id: str | None = None, timeout: float | None = _UNSET,
                       **sampling: Any) -> Result:  # fmt: skip
        gen = _request(prompt, prompt_token_ids, messages, request_id, False, sampling)
        chunks: list[TokenChunk] = []
        async for event in self._events(gen, timeout):
            if isinstance(event, TokenChunk):
                chunks.append(event)
            else:
                return _result(gen.request_id, chunks, event)
        raise AssertionError("unreachable: _events ends with Finished or raises")

    async def stream(self, prompt: str | None = None, *,
                     prompt_token_ids: Sequence[int] | None = None,
                     messages: Sequence[ChatMessage | dict[str, str]] | None = None,
                     request_id: str | None = None, timeout: float | None = _UNSET,
                     **sampling: Any) -> AsyncIterator[TokenChunk]:  # fmt: skip
        gen = _request(prompt, prompt_token_ids, messages, request_id, True, sampling)
        async for event in self._events(gen, timeout):
            if isinstance(event, TokenChunk):
                yield event

    async def abort(self, request_id: str) -> None:
        if self._sock.closed:  # the client is closed: nothing of it runs any more
            return
        await self._sock.send(encode(Abort(request_id=request_id)))

    async def _events(
        self, gen: Generate, timeout: float | None
    ) -> AsyncIterator[TokenChunk | Finished]:
        rid = gen.request_id
        timeout = self.timeout if timeout is _UNSET else timeout
        deadline = _deadline(timeout)
        queue: asyncio.Queue[Event] = asyncio.Queue()
        self._handshakes.check(rid)
        self._queues[rid] = queue
        if self._receiver is None or self._receiver.done():
            self._receiver = asyncio.create_task(self._receive())
        ended = False
        waiting_since = time.monotonic()
        try:
            await self._sock.send(encode(gen))
            while not ended:
                # A deadline per wait, not asyncio.timeout around the loop: that would
                # cancel the consumer's own code while it holds a chunk between yields.
                event = None
                while event is None:
                    self._handshakes.check_reachable(rid, waiting_since)
                    remaining = None if deadline is None else deadline - time.monotonic()
                    if remaining is not None and remaining <= 0:
                        raise GenerationTimeout(rid, timeout or 0.0)
                    wait = REACHABLE_CHECK_S if remaining is None else min(remaining,
                                                                           REACHABLE_CHECK_S)  # fmt: skip
                    with suppress(TimeoutError):
                        event = await asyncio.wait_for(queue.get(), wait)
                ended = isinstance(event, (Finished, Failed))
                if isinstance(event, Failed):
                    raise _failed(event)
                yield event
        finally:
            self._queues.pop(rid, None)
            if not ended:  # no await here: a finally may run while being cancelled or GC'd
                task = asyncio.get_running_loop().create_task(self.abort(rid))
                self._background.add(task)
                task.add_done_callback(self._background.discard)

    async def _receive(self) -> None:
        poller = zmq.asyncio.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._handshakes.monitor, zmq.POLLIN)
        while True:
            ready = dict(await poller.poll())
            if self._handshakes.monitor in ready:
                self._handshakes.route(
                    await self._handshakes.monitor.recv_multipart(), self._queues
                )
            if self._sock in ready:
                self._inbox.route(await self._sock.recv_multipart(), self._queues)

    async def close(self) -> None:
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)
        if self._receiver is not None:
            self._receiver.cancel()
            await asyncio.gather(self._receiver, return_exceptions=True)
        self._handshakes.close(self._sock)
        self._sock.close(linger=ABORT_FLUSH_MS)  # aborts already sent still leave

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
