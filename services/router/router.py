"""The router's dispatch core: validates, picks instances, relays prefill -> decode.

Every accepted request gets exactly one terminal event (Finished or Failed). A consumer
that stops early (client gone) aborts the request on whichever service holds it. The
links to the instances (liveness, receiving, metrics scrapes) are `Instances`
(instances.py); where a request goes (a live instance, local prefill, a decode that can
reach the producer) is `Placement` (placement.py) over them, which `Router` extends.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import structlog

from pdserve.common.engine.block_pool import BlockHash, hash_blocks
from pdserve.common.errors import RequestError
from pdserve.common.model.checkpoint.tokenizer import Tokenizer
from pdserve.common.runtime import protocol as p
from pdserve.common.runtime.service_config import DeploymentConfig
from pdserve.common.runtime.ttft import ttft_parts
from pdserve.services.router.core_api import Refused
from pdserve.services.router.fair_queue import FairQueue
from pdserve.services.router.links import reachable_prefills
from pdserve.services.router.placement import Placement
from pdserve.services.router.request_state import (
    MAX_LABEL_CHARS,
    PHASE_KEYS,
    PHASES,
    SLOT_GIVEN,
    Event,
    RequestState,
    SlotGiven,
)

__all__ = ["MAX_LABEL_CHARS", "Event", "Router"]

MAX_CLASS_CHARS = 64  # a client's name as a metrics label

log = structlog.get_logger("pdserve.router")


class Router(Placement):
    def __init__(
        self,
        cfg: DeploymentConfig,
        tokenizer: Tokenizer,
        model_name: str,
        max_model_len: int,
        vocab_size: int,
    ) -> None:
        super().__init__(cfg)
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.trust_user_field = cfg.trust_user_field
        # A text longer than this has more tokens than max_model_len: refused untokenised.
        self.max_prompt_chars = max_model_len * tokenizer.longest_token_chars
        self.per_owner: dict[str, int] = {}  # requests in flight by owner (their cap)
        # dispatch slots, clients served by tokens served (VTC) and priority
        self.admission = FairQueue(cfg.dispatch_window, cfg.client_dispatch_share)
        self.client_classes: dict[str, str] = {}  # owner -> its metrics label (bounded)
        for phase in PHASES:
            self.metrics.declare("pdserve:request_timeouts", phase=phase)
        self.owned: dict[tuple[str, str], str] = {}  # (owner, label) -> request id
        self.draining = False  # SIGTERM: new requests fail "draining" (main.py drains)

    # -- the RouterCore surface -------------------------------------------------------------

    def is_ready(self) -> bool:
        now = time.monotonic()
        return (
            not self.draining
            and bool(self.decodes)
            and all(link.is_alive(now, self.peer_timeout) for link in self.links)
        )

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
        refusal = self._refusal(owner)
        if refusal is not None:
            raise Refused(*refusal)
        rid = f"req-{uuid.uuid4().hex}"
        state = RequestState(rid, uuid.uuid4().hex, len(ids), label=label or rid, owner=owner,
                             priority=gen.priority, client_class=self._client_class(owner))  # fmt: skip
        return self._labelled(state, self._run(state, ids, gen.sampling))

    def _client_class(self, owner: str) -> str:
        """``owner``'s label on the per-client metrics: its own for the first
        ``max_client_classes`` clients seen, "other" past them (bounded cardinality)."""
        label = self.client_classes.get(owner)
        if label is None:
            if len(self.client_classes) >= self.cfg.max_client_classes:
                return "other"
            label = self.client_classes[owner] = owner[:MAX_CLASS_CHARS] or "anonymous"
        return label

    def _serve(self, state: RequestState, tokens: int) -> None:
        """``tokens`` served to ``state``'s client: its virtual counter, its metric."""
        self.admission.serve(state.owner, tokens)
        self.metrics.inc("pdserve:client_served_tokens", tokens, client_class=state.client_class)

    def _refusal(self, owner: str) -> tuple[str, str] | None:
        """Why a new request of ``owner`` is refused now (reason, message), if it is."""
        if self.draining:
            return ("draining", "the router is shutting down (draining); retry the request")
        if len(self.requests) >= self.cfg.max_queued_requests:
            return ("overloaded", f"the router holds {len(self.requests)} requests, its limit "
                    "(max_queued_requests); retry later")  # fmt: skip
        held = self.per_owner.get(owner, 0)
        if held >= self.cfg.max_requests_per_client:  # one client cannot take every slot
            return ("overloaded", f"this client holds {held} requests, its share "
                    "(max_requests_per_client); retry when some have finished")  # fmt: skip
        queued = self.admission.num_waiting_of(owner)
        if self.cfg.max_queued_per_client and queued >= self.cfg.max_queued_per_client:
            return ("overloaded", f"this client has {queued} requests waiting for a dispatch "
                    "slot, its limit (max_queued_per_client); retry when some have "
                    "started")  # fmt: skip
        if self.stall_mark() is not None:  # peers may look down for our own stall: _pick waits
            return None
        now = time.monotonic()
        for role, links in (("prefill", [] if self.cfg.colocated else self.prefills),
                            ("decode", self.decodes)):  # fmt: skip
            if (links or role == "decode") and not any(
                link.is_alive(now, self.peer_timeout) for link in links
            ):
                return ("peer_down", f"no {role} instance is up; retry later")
        return None

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
        self.metrics.set("pdserve:num_requests_waiting", self.admission.num_waiting)
        return await super().metrics_text()

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
        refusal = self._refusal(state.owner)  # again: others were admitted since submit
        if refusal is not None and refusal[0] != "peer_down":  # that one is judged at pick
            yield self._failed(state, *refusal)
            return
        self.requests[rid] = state
        self.per_owner[state.owner] = self.per_owner.get(state.owner, 0) + 1
        got_first = False
        last = state.arrived
        try:
            if not self.admission.join(state.owner, rid, state.priority):  # waits its turn
                event = await self._next(state, self.cfg.first_token_timeout_seconds, "queue")
                if not isinstance(event, SlotGiven):  # aborted, drained or timed out
                    yield self._ended(state, event)
                    return
            self.metrics.observe("pdserve:client_queue_seconds", time.monotonic() - state.arrived,
                                 client_class=state.client_class)  # fmt: skip
            if not state.queue.empty():  # it ended while its slot was on the way
                yield self._ended(state, state.queue.get_nowait())
                return
            self._serve(state, state.num_prompt_tokens)
            first_token, num_cached, handle, first_logprobs = None, 0, None, None
            prompt_logprobs: list[p.TokenLogprobs] | None = None
            hashes = [] if self.cfg.colocated else hash_blocks(ids, self.block_size)
            local = None if self.cfg.colocated else await self._local_prefill(state, hashes)
            if not self.cfg.colocated and local is None:
                done = await self._prefill(state, ids, hashes, sampling)
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
            decode = local or await self._pick(self._decodes_for(handle))
            if decode is None:
                yield self._failed(state, "peer_down", "no decode instance is up; retry later")
                return
            decode.remember(hashes)  # its prefix cache will hold them, pulled or computed
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
                    client=state.owner,
                    priority=state.priority,
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
                        self._local_prefilled(state)
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
                    self._serve(state, len(event.token_ids))
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
            self._local_prefilled(state, answered=False)
            if not state.finished:  # the consumer left (client gone): counted as an abort
                self.metrics.inc("pdserve:requests", finish_reason="abort")
            if not state.finished and state.link is not None:
                self._send(state.link, p.Abort(request_id=rid, trace_id=trace))
                bound.info("request_aborted", at=state.link.name)
            self._undispatch(state)
            for key in self.admission.leave(state.owner, rid):
                self.requests[key].queue.put_nowait(SLOT_GIVEN)
            self.requests.pop(rid, None)
            left = self.per_owner.get(state.owner, 1) - 1
            if left > 0:
                self.per_owner[state.owner] = left
            else:
                self.per_owner.pop(state.owner, None)

    async def _prefill(
        self,
        state: RequestState,
        ids: list[int],
        hashes: list[BlockHash],
        sampling: p.SamplingParams,
    ) -> p.PrefillDone | p.Failed | p.Finished:
        now = time.monotonic()
        prefills = reachable_prefills(self.prefills, self.decodes, now, self.peer_timeout)
        link = await self._pick(prefills, hashes)
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
                client=state.owner,
                priority=state.priority,
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
        if not state.queue.empty():  # already here: no deadline to arm
            return state.queue.get_nowait()
        if timeout <= 0:
            return await state.queue.get()
        try:
            # a timer, not wait_for's task per call: this runs for every token of every stream
            async with asyncio.timeout(timeout):
                return await state.queue.get()
        except TimeoutError:
            pass
        at = state.link.name if state.link is not None else "the router"
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
            message=f"{at} gave {what} within {timeout:g} s "
            f"({PHASE_KEYS.get(phase, f'{phase}_timeout_seconds')}); retry the request",
        )

    def _observe_ttft_parts(self, state: RequestState, first: p.TokenChunk) -> None:
        marks = {**state.marks, **first.timings, "router_first_chunk": time.time()}
        for part, seconds in ttft_parts(marks).items():
            self.metrics.observe("pdserve:ttft_part_seconds", seconds, part=part)

    def _ended(self, state: RequestState, event: Event) -> Event:
        """A request that ends before it was dispatched (an abort, the drain, a timeout)."""
        state.finished = True
        outcome = event.finish_reason if isinstance(event, p.Finished) else "failed"
        self.metrics.inc("pdserve:requests", finish_reason=outcome)
        return event

    def _failed(self, state: RequestState, reason: str, message: str) -> p.Failed:
        state.finished = True
        self.metrics.inc("pdserve:requests", finish_reason="failed")
        return p.Failed(
            request_id=state.request_id, trace_id=state.trace_id, reason=reason, message=message
        )
