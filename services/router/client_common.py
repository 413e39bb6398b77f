"""What the SDK's two clients share: the request they build (checked as the HTTP API
checks it), their one DEALER socket, reply frames routed to requests by id, handshake
failures watched, and results and errors as the caller sees them."""

from __future__ import annotations

import re
import time
import uuid
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeAlias, TypeVar

import msgspec
import structlog
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from pdserve.common.engine.sampling_params import SamplingParams, TokenLogprobs
from pdserve.common.errors import PdserveError, RequestError
from pdserve.common.runtime.curve import CurveKeys, describe_failure
from pdserve.common.runtime.protocol import (
    ChatMessage,
    Decoder,
    Failed,
    Finished,
    Generate,
    RouterToClient,
    TokenChunk,
    Usage,
)
from pdserve.common.runtime.sockets import HEARTBEAT_TIMEOUT_MS, make_socket

log = structlog.get_logger("pdserve.client")

_SANE_ID = re.compile(r"[\x21-\x7e]{1,128}")  # the HTTP API's x-request-id rule
HWM = 100_000  # per-token frames of many concurrent streams; queued, not dropped
Event: TypeAlias = TokenChunk | Finished | Failed
_S = TypeVar("_S", bound=zmq.Socket[Any])  # a sync or an asyncio socket
_HANDSHAKE_EVENTS = (
    zmq.EVENT_HANDSHAKE_SUCCEEDED
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
    | zmq.EVENT_DISCONNECTED
)


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


def dealer(ctx: zmq.Context[_S], address: str, curve: CurveKeys | None) -> _S:
    """The client's one socket, from the project's socket factory."""
    return make_socket(ctx, zmq.DEALER, connect=address, hwm=HWM, curve=curve,
                       monitor_events=_HANDSHAKE_EVENTS)  # fmt: skip


def build_request(
    prompt: str | None,
    prompt_token_ids: Sequence[int] | None,
    messages: Sequence[ChatMessage | dict[str, str]] | None,
    request_id: str | None,
    stream: bool,
    sampling: dict[str, Any],
) -> Generate:
    if sum(x is not None for x in (prompt, prompt_token_ids, messages)) != 1:
        raise RequestError("pass exactly one of prompt, prompt_token_ids or messages")
    sampling = dict(sampling)
    priority = sampling.pop("priority", 0)  # vLLM's: lower is served first (not sampling)
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise RequestError(f"priority must be an int (lower is served first), got {priority!r}")
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
        priority=priority,
    )


def result_of(request_id: str, chunks: list[TokenChunk], finished: Finished) -> Result:
    return Result(
        request_id=request_id,
        text="".join(c.text for c in chunks),
        token_ids=[t for c in chunks for t in c.token_ids],
        finish_reason=finished.finish_reason,
        usage=finished.usage,
        logprobs=[lp for c in chunks for lp in c.logprobs],
        prompt_logprobs=next((c.prompt_logprobs for c in chunks if c.prompt_logprobs), None),
    )


def failed_error(event: Failed) -> GenerationFailed:
    return GenerationFailed(event.reason, event.message, event.request_id)


def deadline_of(timeout: float | None) -> float | None:
    return None if timeout is None else time.monotonic() + timeout


def put_event(queue: Any, event: Event) -> None:
    if isinstance(queue, deque):
        queue.append(event)
    else:
        queue.put_nowait(event)


class Handshakes:
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
                put_event(queue, Failed(request_id=rid, reason="unreachable", message=lost))
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
            put_event(queue, Failed(request_id=rid, reason="unauthenticated", message=self.refused))

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


class Inbox:
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
            put_event(queue, event)
