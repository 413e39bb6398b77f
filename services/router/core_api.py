"""What the front ends (HTTP API, ZMQ SDK endpoint) need from the router's dispatch core.

A Protocol, not a base class, so the HTTP layer and its tests depend only on this
surface: the real core (``router.py``) and a test fake both satisfy it structurally.
``Batch`` is the consuming side: several ``submit`` streams run at once and are closed
(so aborted) together.

Request ids
-----------
``Generate.request_id`` is the id every reply carries, so whoever sends the request
must be able to route replies by it:

- The HTTP layer always sets it: ``cmpl-<base>`` (completions) or ``chatcmpl-<base>``
  (chat), where ``<base>`` is the caller's ``x-request-id`` header when it is a sane
  token (1-128 printable ASCII characters, no spaces), else a fresh uuid4 hex. The
  header is echoed back in the response's ``x-request-id`` (the generated id when the
  caller sent none), so one id follows a request through the client's logs and ours.
  A batch completion (several prompts) submits one ``Generate`` per prompt, with ids
  ``<request_id>-<prompt index>``. If a caller reuses an ``x-request-id`` while the
  first request is still running, the second gets a random suffix: ids stay unique.
- The ZMQ SDK sets it too (``sdk-<uuid4 hex>`` unless the caller names one), because it
  multiplexes many requests on one socket and routes reply frames by this id.
- The core replies with the caller's ``request_id`` (a label of at most 128 characters,
  unique per ``owner``: the submitting connection) but gives the request an id of its
  own (``req-<uuid4 hex>``) for the services, so no client can collide with, or abort,
  another's request: ``abort(request_id, owner)`` reaches only that owner's.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable
from typing import Any, Protocol, TypeAlias

from pdserve.common.errors import PdserveError
from pdserve.common.model.checkpoint.tokenizer import Tokenizer
from pdserve.common.runtime.protocol import Failed, Finished, Generate, TokenChunk

Event: TypeAlias = TokenChunk | Finished | Failed
_TERMINAL = (Finished, Failed)


class Refused(PdserveError):
    """The router takes no such request now: ``reason`` is a Failed's (overloaded,
    draining, peer_down, timeout, internal), for the front end's status code. Raised by
    ``submit`` (so a stream's headers are only sent for an admitted request) and by the
    tokenize pool."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class RouterCore(Protocol):
    model_name: str  # the served model id, shown by /v1/models and checked against `model`
    max_model_len: int  # prompt + completion tokens, at most
    tokenizer: Tokenizer
    # an OpenAI body's ``user`` names its client for fair admission (trust_user_field)
    trust_user_field: bool

    def submit(self, gen: Generate, owner: str = "") -> AsyncIterator[Event]:
        """Validate ``gen`` (raising RequestError) and admit it (raising Refused when the
        core is overloaded, draining or has no instance up) before returning; then yield
        TokenChunks and exactly one Finished or Failed (a refusal that raced the admission
        included). Stopping early (``aclose()`` or cancelling the consumer) aborts the
        request inside the core. ``owner``: the client, whose requests take turns with
        other clients' (fair admission) and only it may abort."""
        ...

    async def abort(self, request_id: str, owner: str = "") -> None:
        """Abort ``owner``'s request ``request_id``; another owner's is untouched."""
        ...

    def is_ready(self) -> bool:
        """Every service the core routes to is up and has answered its handshake."""
        ...

    def health_detail(self) -> dict[str, Any]: ...

    def metrics_text(self) -> Awaitable[bytes]:
        """Prometheus text exposition (format 0.0.4) of the router and its services."""
        ...


class Batch:
    """One task per prompt iterating the core, events merged into one queue, tagged by
    prompt index. Closing cancels the tasks, which closes the core's iterators (abort)."""

    def __init__(self) -> None:
        self._queue: asyncio.Queue[tuple[int, Event | Exception]] = asyncio.Queue()
        self._tasks: list[asyncio.Task[None]] = []
        self._buffered: list[tuple[int, Event]] = []
        self._seen: set[int] = set()  # indices whose first event has arrived

    def add(self, events: AsyncIterator[Event], index: int | None = None) -> None:
        """``index``: the prompt index the events are tagged with (default: the order
        of adding)."""
        index = len(self._tasks) if index is None else index
        self._tasks.append(asyncio.create_task(self._pump(index, events)))

    async def _pump(self, index: int, events: AsyncIterator[Event]) -> None:
        ended = False
        try:
            async for event in events:
                ended = isinstance(event, _TERMINAL)
                self._queue.put_nowait((index, event))
            if not ended:  # the core broke its contract: never leave the client hanging
                raise RuntimeError("the core ended a request without Finished or Failed")
        except Exception as exc:  # noqa: BLE001 - handed to the consumer, which answers 500
            self._queue.put_nowait((index, exc))
        finally:
            aclose = getattr(events, "aclose", None)
            if aclose is not None:
                await aclose()

    async def first_events(self) -> list[Event]:
        """The first event of every prompt added so far (kept, to be replayed by
        ``events``); call again after adding more."""
        while len(self._seen) < len(self._tasks):
            index, event = await self._next()
            self._seen.add(index)
            self._buffered.append((index, event))
        return [event for _, event in self._buffered]

    async def _next(self) -> tuple[int, Event]:
        index, event = await self._queue.get()
        if isinstance(event, Exception):
            raise event
        return index, event

    async def events(self) -> AsyncIterator[tuple[int, Event]]:
        open_prompts = len(self._tasks)
        buffered, self._buffered = self._buffered, []
        for item in buffered:
            open_prompts -= isinstance(item[1], _TERMINAL)
            yield item
        while open_prompts:
            item = await self._next()
            open_prompts -= isinstance(item[1], _TERMINAL)
            yield item

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
