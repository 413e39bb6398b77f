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
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import suppress
from typing import Any, Self

import zmq
import zmq.asyncio

from pdserve.common.runtime.curve import CurveKeys
from pdserve.common.runtime.protocol import (
    Abort,
    ChatMessage,
    Failed,
    Finished,
    Generate,
    TokenChunk,
    encode,
)
from pdserve.services.router.client_common import (
    Event,
    GenerationFailed,
    GenerationTimeout,
    Handshakes,
    Inbox,
    Result,
    build_request,
    deadline_of,
    dealer,
    failed_error,
    result_of,
)

__all__ = [
    "DEFAULT_ADDRESS",
    "DEFAULT_CONNECT_TIMEOUT_S",
    "DEFAULT_TIMEOUT_S",
    "AsyncClient",
    "Client",
    "GenerationFailed",
    "GenerationTimeout",
    "Result",
]

DEFAULT_ADDRESS = "tcp://127.0.0.1:5600"  # DeploymentConfig's front_address by default
DEFAULT_TIMEOUT_S = 600.0
DEFAULT_CONNECT_TIMEOUT_S = 10.0
ABORT_FLUSH_MS = 1_000  # close() waits this long at most for queued aborts to leave
POLL_SLICE_S = 0.05  # the sync client releases the socket this often for other threads
REACHABLE_CHECK_S = 0.25  # the async client checks the router's connection this often
UNSET: Any = object()  # a timeout argument not given (None means "no bound")


class Client:
    """Blocking client; safe to share between threads (one socket, guarded by a lock)."""

    def __init__(self, address: str = DEFAULT_ADDRESS, *,
                 timeout: float | None = DEFAULT_TIMEOUT_S,
                 connect_timeout: float = DEFAULT_CONNECT_TIMEOUT_S,
                 ctx: zmq.Context[Any] | None = None,
                 curve: CurveKeys | None = None) -> None:  # fmt: skip
        self.address = address
        self.timeout = timeout
        self._sock = dealer(ctx or zmq.Context.instance(), address, curve)
        self._handshakes = Handshakes(self._sock, address, curve, connect_timeout)
        self._poller = zmq.Poller()
        self._poller.register(self._sock, zmq.POLLIN)
        self._poller.register(self._handshakes.monitor, zmq.POLLIN)
        self._lock = threading.Lock()
        self._queues: dict[str, deque[Event]] = {}
        self._inbox = Inbox()

    def generate(self, prompt: str | None = None, *, prompt_token_ids: Sequence[int] | None = None,
                 messages: Sequence[ChatMessage | dict[str, str]] | None = None,
                 request_id: str | None = None, timeout: float | None = UNSET,
                 **sampling: Any) -> Result:  # fmt: skip
        """Generate to the end; ``sampling`` are SamplingParams fields (max_tokens, ...) and
        ``priority`` (vLLM's: lower is served first, default 0)."""
        gen = build_request(prompt, prompt_token_ids, messages, request_id, False, sampling)
        chunks: list[TokenChunk] = []
        for event in self._events(gen, timeout):
            if isinstance(event, TokenChunk):
                chunks.append(event)
            else:
                return result_of(gen.request_id, chunks, event)
        raise AssertionError("unreachable: _events ends with Finished or raises")

    def stream(self, prompt: str | None = None, *, prompt_token_ids: Sequence[int] | None = None,
               messages: Sequence[ChatMessage | dict[str, str]] | None = None,
               request_id: str | None = None, timeout: float | None = UNSET,
               **sampling: Any) -> Iterator[TokenChunk]:  # fmt: skip
        """TokenChunks as they come; breaking out of the loop aborts the request."""
        gen = build_request(prompt, prompt_token_ids, messages, request_id, True, sampling)
        for event in self._events(gen, timeout):
            if isinstance(event, TokenChunk):
                yield event

    def abort(self, request_id: str) -> None:
        self._send(Abort(request_id=request_id))

    def _events(self, gen: Generate, timeout: float | None) -> Iterator[TokenChunk | Finished]:
        rid = gen.request_id
        timeout = self.timeout if timeout is UNSET else timeout
        deadline = deadline_of(timeout)
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
                    raise failed_error(event)
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
        self._sock = dealer(ctx or zmq.asyncio.Context.instance(), address, curve)
        self._handshakes = Handshakes(self._sock, address, curve, connect_timeout)
        self._queues: dict[str, asyncio.Queue[Event]] = {}
        self._inbox = Inbox()
        self._receiver: asyncio.Task[None] | None = None
        self._background: set[asyncio.Task[None]] = set()  # fire-and-forget aborts

    async def generate(self, prompt: str | None = None, *,
                       prompt_token_ids: Sequence[int] | None = None,
                       messages: Sequence[ChatMessage | dict[str, str]] | None = None,
                       request_id: str | None = None, timeout: float | None = UNSET,
                       **sampling: Any) -> Result:  # fmt: skip
        gen = build_request(prompt, prompt_token_ids, messages, request_id, False, sampling)
        chunks: list[TokenChunk] = []
        async for event in self._events(gen, timeout):
            if isinstance(event, TokenChunk):
                chunks.append(event)
            else:
                return result_of(gen.request_id, chunks, event)
        raise AssertionError("unreachable: _events ends with Finished or raises")

    async def stream(self, prompt: str | None = None, *,
                     prompt_token_ids: Sequence[int] | None = None,
                     messages: Sequence[ChatMessage | dict[str, str]] | None = None,
                     request_id: str | None = None, timeout: float | None = UNSET,
                     **sampling: Any) -> AsyncIterator[TokenChunk]:  # fmt: skip
        gen = build_request(prompt, prompt_token_ids, messages, request_id, True, sampling)
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
        timeout = self.timeout if timeout is UNSET else timeout
        deadline = deadline_of(timeout)
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
                    raise failed_error(event)
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
