"""The router's dispatch core: validates, picks instances, relays prefill -> decode.

Every accepted request gets exactly one terminal event (Finished or Failed). A consumer
that stops early (client gone) aborts the request on whichever service holds it.

An instance is down when its connection drops (at once) or when it has answered no ping
for ``peer_timeout_seconds``: its requests in flight fail with ``peer_down`` naming it,
and nothing is routed to it until it answers a ping as ready again. An instance that
answers "not ready" (starting, draining) only stops getting new requests: it still
answers the ones it holds.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import msgspec
import structlog
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from pdserve.common.engine.block_pool import hash_blocks
from pdserve.common.errors import RequestError
from pdserve.common.model.tokenizer import Tokenizer
from pdserve.common.runtime import protocol as p
from pdserve.common.runtime.curve import HandshakeLog, WireSecurity
from pdserve.common.runtime.loop_lag import LoopLag
from pdserve.common.runtime.metrics import Metrics, render
from pdserve.common.runtime.service_config import DeploymentConfig
from pdserve.common.runtime.sockets import make_socket
from pdserve.common.runtime.ttft import ttft_parts
from pdserve.services.router.links import Link, pick

log = structlog.get_logger("pdserve.router")

PEER_TIMEOUT = 5.0  # no Pong for this long: the instance is down, its requests fail
MAX_LABEL_CHARS = 128  # a client's own request id, kept as the label its replies carry
SCRAPE_TIMEOUT = 2.0

Event = p.TokenChunk | p.Finished | p.Failed
PHASES = {  # a request's phases with a deadline: what did not come
    "prefill": "no prefill answer",
    "first_token": "no first token",
    "token_gap": "no next token",
}


@dataclass
class RequestState:
    request_id: str  # the router's own, unique; what the services see
    trace_id: str
    num_prompt_tokens: int
    label: str = ""  # the client's id for it: what its replies carry
    owner: str = ""  # the connection that submitted it: only it may abort it
    arrived: float = field(default_factory=time.monotonic)
    marks: dict[str, float] = field(
        default_factory=lambda: {"arrived": time.time()}
    )  # common/runtime/ttft.py
    queue: asyncio.Queue[Any] = field(default_factory=asyncio.Queue)
    link: Link | None = None  # the instance holding the request now
    finished: bool = False


class Router:
    def __init__(
        self,
        cfg: DeploymentConfig,
        tokenizer: Tokenizer,
        model_name: str,
        max_model_len: int,
        vocab_size: int,
    ) -> None:
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.block_size = cfg.engine.block_size
        # A text longer than this has more tokens than max_model_len: refused untokenised.
        self.max_prompt_chars = max_model_len * tokenizer.longest_token_chars
        self.per_owner: dict[str, int] = {}  # requests in flight by owner (fair admission)
        self.metrics = Metrics("router", 0)
        self.security = WireSecurity.counted(cfg.security, self.metrics)
        self.metrics.declare("pdserve:bad_messages")
        for phase in PHASES:
            self.metrics.declare("pdserve:request_timeouts", phase=phase)
        self.ping_seconds = cfg.ping_seconds
        self.peer_timeout = cfg.peer_timeout_seconds
        self.ctx = zmq.asyncio.Context()
        self.prefills: list[Link] = []
        self.decodes: list[Link] = []
        self.requests: dict[str, RequestState] = {}
        self.owned: dict[tuple[str, str], str] = {}  # (owner, label) -> request id
        self._scrapes: dict[str, asyncio.Future[p.MetricsReport]] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self.draining = False  # SIGTERM: new requests fail "draining" (main.py drains)

    async def start(self) -> None:
        if not self.cfg.colocated:
            for i, addrs in enumerate(self.cfg.prefill_addresses):
                self.prefills.append(self._link("prefill", i, addrs.address))
        for i, addrs in enumerate(self.cfg.decode_addresses):
            self.decodes.append(self._link("decode", i, addrs.address))
        self._tasks.append(asyncio.create_task(self._ping_loop()))

    def _link(self, role: str, index: int, address: str) -> Link:
        sock = make_socket(self.ctx, zmq.DEALER, connect=address, curve=self.security.client,
                           monitor_events=zmq.EVENT_DISCONNECTED)  # fmt: skip
        link = Link(role, index, address, sock)
        union = p.PrefillToRouter if role == "prefill" else p.DecodeToRouter
        monitor = sock.get_monitor_socket()  # attached by make_socket
        self._tasks.append(asyncio.create_task(self._receive(link, p.Decoder(union))))
        self._tasks.append(asyncio.create_task(self._watch_connection(link, monitor)))
        self.metrics.declare("pdserve:peer_down", peer=link.name)
        return link

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        self.ctx.destroy(linger=0)

    @property
    def links(self) -> list[Link]:
        return self.prefills + self.decodes

    # -- the RouterCore surface -------------------------------------------------------------

    def is_ready(self) -> bool:
        now = time.monotonic()
        return (
            not self.draining
            and bool(self.decodes)
            and all(link.is_alive(now, self.peer_timeout) for link in self.links)
        )

    def health_detail(self) -> dict[str, Any]:
        now = time.monotonic()
        return {
            link.name: {
                "address": link.address,
                "ready": link.is_alive(now, self.peer_timeout),
                "inflight": len(link.inflight),
            }
            for link in self.links
        }

    def submit(self, gen: p.Generate, owner: str = "") -> AsyncIterator[Event]:
        """Validates now (RequestError), then runs the request as the iterator is consumed.
        ``owner``: the submitting connection; ``gen.request_id`` is unique per owner and
        only that owner may abort it. The services see an id of the router's own."""
        label = gen.request_id
        if len(label) > MAX_LABEL_CHARS:
            raise RequestError(
                f"request_id has {len(label)} characters, more than {MAX_LABEL_CHARS}"
            )
        if label and (owner, label) in self.owned:
            raise RequestError(f"request id {label!r} is already in use by this client")
        ids = self._prompt_ids(gen)
        gen.sampling.validate(self.vocab_size)
        if len(ids) > self.max_model_len:
            raise RequestError(
                f"the prompt has {len(ids)} tokens, more than max_model_len {self.max_model_len}"
            )
        room = self.max_model_len - len(ids)
        if gen.sampling.max_tokens > room:  # as the HTTP API refuses it, for SDK callers too
            raise RequestError(
                f"max_tokens {gen.sampling.max_tokens} plus the prompt's {len(ids)} tokens "
                f"exceeds max_model_len {self.max_model_len}; ask for at most {max(room, 0)}"
            )
        rid = f"req-{uuid.uuid4().hex}"
        state = RequestState(rid, uuid.uuid4().hex, len(ids), label=label or rid, owner=owner)
        return self._labelled(state, self._run(state, ids, gen.sampling))

    async def _labelled(
        self, state: RequestState, events: AsyncIterator[Event]
    ) -> AsyncIterator[Event]:
        """The request's events as its client named it."""
        key = (state.owner, state.label)
        self.owned[key] = state.request_id
        try:
            async for event in events:
                if state.label != state.request_id:
                    event = msgspec.structs.replace(event, request_id=state.label)
                yield event
        finally:
            if self.owned.get(key) == state.request_id:
                del self.owned[key]
            await events.aclose()  # type: ignore[attr-defined]

    async def abort(self, request_id: str, owner: str = "") -> None:
        """Abort ``owner``'s request ``request_id`` (its label); anyone else's is untouched."""
        rid = self.owned.get((owner, request_id))
        state = self.requests.get(rid) if rid is not None else None
        if state is not None and not state.finished:
            if state.link is not None:
                abort = p.Abort(request_id=state.request_id, trace_id=state.trace_id)
                self._send(state.link, abort)
            state.queue.put_nowait(
                p.Finished(
                    request_id=state.request_id,
                    trace_id=state.trace_id,
                    finish_reason="abort",
                    usage=p.Usage(prompt_tokens=state.num_prompt_tokens, completion_tokens=0),
                )
            )

    def fail_all(self, reason: str, message: str) -> None:
        """End every request in flight with Failed (the drain's deadline); the services
        holding them are told to abort."""
        for state in list(self.requests.values()):
            if state.link is not None:
                self._send(
                    state.link, p.Abort(request_id=state.request_id, trace_id=state.trace_id)
                )
            state.queue.put_nowait(
                p.Failed(
                    request_id=state.request_id,
                    trace_id=state.trace_id,
                    reason=reason,
                    message=message,
                )
            )

    async def metrics_text(self) -> bytes:
        self.metrics.set("pdserve:num_requests_running", len(self.requests))  # held here now
        loop = asyncio.get_running_loop()
        waits = []
        for link in self.links:
            if not link.ready:
                continue
            fut: asyncio.Future[p.MetricsReport] = loop.create_future()
            self._scrapes[link.name] = fut
            self._send(link, p.MetricsQuery())
            waits.append(fut)
        samples = self.metrics.samples()
        if waits:
            done, _ = await asyncio.wait(waits, timeout=SCRAPE_TIMEOUT)
            for fut in done:
                samples += fut.result().samples
        return render(samples)

    # -- one request ------------------------------------------------------------------------

    def check_chars(self, num_chars: int) -> None:
        """Refuse a text that cannot fit max_model_len, before tokenising it."""
        if num_chars > self.max_prompt_chars:
            raise RequestError(
                f"the prompt has {num_chars} characters: more than max_model_len "
                f"{self.max_model_len} tokens can hold (at most {self.max_prompt_chars}); "
                "shorten it"
            )

    def _prompt_ids(self, gen: p.Generate) -> list[int]:
        given = [x is not None for x in (gen.prompt_token_ids, gen.prompt, gen.messages)]
        if sum(given) != 1:
            raise RequestError("give exactly one of prompt, prompt_token_ids or messages")
        if gen.prompt is not None:
            self.check_chars(len(gen.prompt))
        elif gen.messages is not None:
            self.check_chars(sum(len(m.content) + len(m.role) for m in gen.messages))
        if gen.prompt_token_ids is not None:
            ids = list(gen.prompt_token_ids)
            bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
            if bad is not None:
                raise RequestError(
                    f"token id {bad} is outside the vocabulary (0..{self.vocab_size - 1})"
                )
        elif gen.messages is not None:
            ids = self.tokenizer.encode_chat(
                [{"role": m.role, "content": m.content} for m in gen.messages]
            )
        else:
            assert gen.prompt is not None
            ids = self.tokenizer.encode(gen.prompt)
        if not ids:
            raise RequestError("the prompt is empty")
        return ids

    async def _run(
        self, state: RequestState, ids: list[int], sampling: p.SamplingParams
    ) -> AsyncIterator[Event]:
        rid, trace = state.request_id, state.trace_id
        bound = log.bind(request_id=rid, trace_id=trace)
        if self.draining:
            yield self._failed(
                state, "draining", "the router is shutting down (draining); retry the request"
            )
            return
        if len(self.requests) >= self.cfg.max_queued_requests:
            yield self._failed(
                state,
                "overloaded",
                f"the router holds {len(self.requests)} requests, its limit; retry later",
            )
            return
        held = self.per_owner.get(state.owner, 0)
        if held >= self.cfg.max_requests_per_client:  # one client cannot take every slot
            yield self._failed(
                state,
                "overloaded",
                f"this client holds {held} requests, its share (max_requests_per_client); "
                "retry when some have finished",
            )
            return
        self.requests[rid] = state
        self.per_owner[state.owner] = held + 1
        got_first = False
        last = state.arrived
        try:
            first_token, num_cached, handle, first_logprobs = None, 0, None, None
            prompt_logprobs: list[p.TokenLogprobs] | None = None
            if not self.cfg.colocated:
                done = await self._prefill(state, ids, sampling)
                if not isinstance(done, p.PrefillDone):
                    yield done
                    return
                first_token, num_cached, handle = (
                    done.first_token,
                    done.num_cached_tokens,
                    done.handle,
                )
                first_logprobs = done.first_logprobs
                prompt_logprobs = done.prompt_logprobs
                state.marks.update(done.timings)
            decode = pick(self.decodes, timeout=self.peer_timeout)
            if decode is None:
                yield self._failed(state, "peer_down", "no decode instance is up; retry later")
                return
            self._dispatch(
                state,
                decode,
                p.DecodeRequest(
                    request_id=rid,
                    trace_id=trace,
                    prompt_token_ids=ids,
                    sampling=sampling,
                    first_token=first_token,
                    num_cached_tokens=num_cached,
                    handle=handle,
                    first_logprobs=first_logprobs,
                ),
            )
            while True:
                if got_first:
                    event = await self._next(state, self.cfg.token_gap_timeout_seconds, "token_gap")
                else:
                    event = await self._next(
                        state, self.cfg.first_token_timeout_seconds, "first_token"
                    )
                now = time.monotonic()
                if isinstance(event, p.TokenChunk):
                    if not got_first:
                        self.metrics.observe(
                            "pdserve:time_to_first_token_seconds", now - state.arrived
                        )
                        self._observe_ttft_parts(state, event)
                        got_first = True
                        if event.prompt_logprobs is None:  # prefill's, on the first chunk
                            event.prompt_logprobs = prompt_logprobs
                    else:
                        self.metrics.observe("pdserve:inter_token_latency_seconds", now - last)
                    last = now
                    yield event
                    continue
                state.finished = True
                if isinstance(event, p.Finished):
                    self.metrics.inc("pdserve:requests", finish_reason=event.finish_reason)
                    self.metrics.observe("pdserve:e2e_request_latency_seconds", now - state.arrived)
                else:
                    self.metrics.inc("pdserve:requests", finish_reason="failed")
                bound.info(
                    "request_done", outcome=getattr(event, "finish_reason", None) or event.reason
                )
                yield event
                return
        finally:
            if not state.finished:  # the consumer left (client gone): counted as an abort
                self.metrics.inc("pdserve:requests", finish_reason="abort")
            if not state.finished and state.link is not None:
                self._send(state.link, p.Abort(request_id=rid, trace_id=trace))
                bound.info("request_aborted", at=state.link.name)
            self._undispatch(state)
            self.requests.pop(rid, None)
            left = self.per_owner.get(state.owner, 1) - 1
            if left > 0:
                self.per_owner[state.owner] = left
            else:
                self.per_owner.pop(state.owner, None)

    async def _prefill(
        self, state: RequestState, ids: list[int], sampling: p.SamplingParams
    ) -> p.PrefillDone | p.Failed | p.Finished:
        hashes = hash_blocks(ids, self.block_size)
        link = pick(self.prefills, hashes, self.peer_timeout)
        if link is None:
            return self._failed(state, "peer_down", "no prefill instance is up; retry later")
        self._dispatch(
            state,
            link,
            p.PrefillRequest(
                request_id=state.request_id,
                trace_id=state.trace_id,
                prompt_token_ids=ids,
                sampling=sampling,
            ),
        )
        link.remember(hashes)
        event = await self._next(state, self.cfg.prefill_timeout_seconds, "prefill")
        self._undispatch(state)
        if isinstance(event, p.PrefillDone) and not state.queue.empty():
            # Aborted (or failed over) while the answer was on its way: the prefill frees
            # the KV on the Abort, so the handle must never reach a decode instance.
            self._send(link, p.Abort(request_id=state.request_id, trace_id=state.trace_id))
            event = state.queue.get_nowait()
        if not isinstance(event, p.PrefillDone):  # Failed, or Finished by an abort
            self.metrics.inc(
                "pdserve:requests", finish_reason=getattr(event, "finish_reason", "failed")
            )
            state.finished = True
        return event

    async def _next(self, state: RequestState, timeout: float, phase: str) -> Any:
        """The request's next event, or past ``timeout`` (0: none) a Failed "timeout" naming
        the phase and the instance, which is told to abort the request."""
        if timeout <= 0:
            return await state.queue.get()
        try:
            return await asyncio.wait_for(state.queue.get(), timeout)
        except TimeoutError:
            pass
        at = state.link.name if state.link is not None else "?"
        self.metrics.inc("pdserve:request_timeouts", phase=phase)
        log.warning("request_timeout", request_id=state.request_id, trace_id=state.trace_id,
                    phase=phase, at=at, seconds=timeout)  # fmt: skip
        if state.link is not None:
            self._send(state.link, p.Abort(request_id=state.request_id, trace_id=state.trace_id))
        what = PHASES[phase]
        return p.Failed(
            request_id=state.request_id,
            trace_id=state.trace_id,
            reason="timeout",
            message=f"{at} gave {what} within {timeout:g} s ({phase}_timeout_seconds); "
            "retry the request",
        )

    def _observe_ttft_parts(self, state: RequestState, first: p.TokenChunk) -> None:
        marks = {**state.marks, **first.timings, "router_first_chunk": time.time()}
        for part, seconds in ttft_parts(marks).items():
            self.metrics.observe("pdserve:ttft_part_seconds", seconds, part=part)

    def _dispatch(self, state: RequestState, link: Link, msg: p.Message) -> None:
        state.link = link
        link.outstanding_tokens += state.num_prompt_tokens
        link.inflight.add(state.request_id)
        self._send(link, msg)

    def _undispatch(self, state: RequestState) -> None:
        link = state.link
        if link is not None and state.request_id in link.inflight:
            link.inflight.discard(state.request_id)
            link.outstanding_tokens -= state.num_prompt_tokens
        state.link = None

    def _failed(self, state: RequestState, reason: str, message: str) -> p.Failed:
        state.finished = True
        self.metrics.inc("pdserve:requests", finish_reason="failed")
        return p.Failed(
            request_id=state.request_id, trace_id=state.trace_id, reason=reason, message=message
        )

    def _send(self, link: Link, msg: p.Message) -> None:
        try:
            link.sock.send(p.encode(msg), flags=zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            log.warning(
                "send_failed", peer=link.name, message_type=type(msg).__name__, error=str(exc)
            )

    # -- receiving --------------------------------------------------------------------------

    async def _receive(self, link: Link, decoder: p.Decoder[Any]) -> None:
        while True:
            payload = await link.sock.recv()
            try:
                msg = decoder.decode(payload)
            except Exception as exc:
                self.metrics.inc("pdserve:bad_messages")
                log.warning("bad_message", peer=link.name, error=str(exc))
                continue
            if isinstance(msg, p.Pong):
                link.ready, link.last_pong, link.lost = msg.ready, time.monotonic(), False
            elif isinstance(msg, p.MetricsReport):
                fut = self._scrapes.pop(link.name, None)
                if fut is not None and not fut.done():
                    fut.set_result(msg)
            else:
                state = self.requests.get(msg.request_id)
                if state is not None:
                    state.queue.put_nowait(msg)
                elif isinstance(msg, p.PrefillDone | p.TokenChunk):
                    # The request already ended here (aborted, or failed while this instance
                    # looked down): without an Abort the instance would pin its KV until the
                    # lease ran out, or generate for nobody.
                    self._send(link, p.Abort(request_id=msg.request_id, trace_id=msg.trace_id))

    async def _ping_loop(self) -> None:
        lag = LoopLag(self.ping_seconds, self.metrics)
        while True:
            now = time.monotonic()
            stalled = lag.tick()
            for link in self.links:
                if stalled and link.last_pong:  # our stall, not its silence
                    link.last_pong += stalled
                self._send(link, p.Ping(sent_at=time.time(), interval=self.ping_seconds))
                # Silent: down, whether it said ready or not (a draining instance that
                # dies still fails what it held).
                if not link.lost and link.last_pong and now - link.last_pong >= self.peer_timeout:
                    self._peer_down(link, f"answered no ping for {self.peer_timeout:g} s")
                alive = link.is_alive(now, self.peer_timeout)
                if link.up and not alive:  # said "not ready": it still answers what it holds
                    log.warning(
                        "peer_not_ready",
                        peer=link.name,
                        address=link.address,
                        inflight=len(link.inflight),
                    )
                elif alive and not link.up:
                    log.info("peer_up", peer=link.name, address=link.address)
                link.up = alive
            await asyncio.sleep(self.ping_seconds)

    async def _watch_connection(self, link: Link, monitor: zmq.asyncio.Socket) -> None:
        """A dropped connection (the process died, or ZMQ's heartbeat gave up on it) marks
        the instance down at once, not after the ping timeout."""
        handshakes = (
            None
            if self.security.client is None
            else HandshakeLog(link.address, self.security.client)
        )
        while True:
            event = parse_monitor_message(await monitor.recv_multipart())
            if event["event"] == zmq.EVENT_DISCONNECTED and not link.lost:
                self._peer_down(link, "dropped its connection")
            elif handshakes is not None:  # CURVE: a refused handshake is logged
                handshakes(event["event"])

    def _peer_down(self, link: Link, why: str) -> None:
        """Stop routing to ``link`` until it answers a ping as ready again, and fail what it
        holds: the clients learn now. If the instance is still alive, it gets an Abort for
        any of them it answers about later, and aborts them itself once this router's
        pings stop reaching it."""
        link.ready = link.up = False
        link.lost = True
        self.metrics.inc("pdserve:peer_down", peer=link.name)
        log.error(
            "peer_down",
            peer=link.name,
            address=link.address,
            why=why,
            num_failed=len(link.inflight),
        )
        message = f"{link.name} at {link.address} {why}; retry the request"
        for rid in list(link.inflight):
            state = self.requests.get(rid)
            if state is not None:
                state.queue.put_nowait(
                    p.Failed(
                        request_id=rid, trace_id=state.trace_id, reason="peer_down", message=message
                    )
                )
