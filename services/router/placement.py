"""Where a request goes, over the router's links (`Instances`): a live instance (waiting
out this loop's own stall), the decode instance that prefills a prompt itself (conditional
disaggregation, local_prefill.py), the decodes that can reach a handle's producer (a
partition, links.py), and the bookkeeping of a request dispatched to an instance.
`Router` (router.py) extends it with the requests' lives.
"""

from __future__ import annotations

import asyncio
import time

import structlog

from pdserve.common.engine.block_pool import BlockHash
from pdserve.common.runtime import protocol as p
from pdserve.common.runtime.service_config import DeploymentConfig
from pdserve.services.router.instances import Instances
from pdserve.services.router.links import Link, decodes_reaching, pick
from pdserve.services.router.local_prefill import (
    LOCAL,
    REASONS,
    REMOTE,
    PathModels,
    PrefillBacklog,
    local_reason,
    remote_work,
    uncached_tokens,
)
from pdserve.services.router.request_state import RequestState

log = structlog.get_logger("pdserve.router")

STALL_POLL_SECONDS = 0.05


class Placement(Instances):
    def __init__(self, cfg: DeploymentConfig) -> None:
        super().__init__(cfg)
        self.block_size = cfg.engine.block_size
        # conditional disaggregation's measurements: each path's TTFT from the choice, and
        # the choices whose first token has not come yet (request id -> path, work, when)
        self.path_models = PathModels()
        self._choices: dict[str, tuple[str, int, float]] = {}
        self.clock = time.monotonic  # when a choice was made and answered (tests step it)
        if not cfg.colocated:
            for reason in REASONS:
                self.metrics.declare("pdserve:local_prefills", reason=reason)

    async def _pick(self, links: list[Link], hashes: list[BlockHash] | None = None) -> Link | None:
        """A live instance. Right after this loop stalled, only one that answered a ping
        since, waiting up to ``peer_timeout_seconds`` for one to (``stall_mark``): the
        request waits instead of failing 503, or of being sent down a connection about to
        be found dropped."""
        deadline = time.monotonic() + self.peer_timeout
        while True:
            mark = self.stall_mark()
            heard = links if mark is None else [link for link in links if link.heard > mark]
            link = pick(heard, hashes, self.peer_timeout)
            if link is not None or mark is None or time.monotonic() >= deadline:
                return link
            await asyncio.sleep(STALL_POLL_SECONDS)

    async def _local_prefill(self, state: RequestState, hashes: list[BlockHash]) -> Link | None:
        """The decode instance that prefills this prompt itself (conditional
        disaggregation, local_prefill.py), its tokens counted in that instance's local
        backlog until the first token; None: a prefill instance computes it."""
        threshold = self.cfg.local_prefill_threshold
        if threshold <= 0:
            return None
        decode = await self._pick(self.decodes)
        if decode is None:
            return None  # judged again after the prefill, as without conditional prefill
        num, size, now = state.num_prompt_tokens, self.block_size, time.monotonic()
        backlogs = [
            PrefillBacklog(link.outstanding_tokens,
                           uncached_tokens(num, link.cached_prefix(hashes), size))
            for link in self.prefills if link.is_alive(now, self.peer_timeout)
        ]  # fmt: skip
        uncached = uncached_tokens(num, decode.cached_prefix(hashes), size)
        queued = decode.local_queued_tokens
        reason = local_reason(threshold, uncached, queued, backlogs, self.path_models)
        if reason is None:
            work = remote_work(backlogs)
            if work is not None:
                self._choices[state.request_id] = (REMOTE, work, self.clock())
            return None
        self._choices[state.request_id] = (LOCAL, queued + uncached, self.clock())
        self.metrics.inc("pdserve:local_prefills", reason=reason)
        log.debug("local_prefill", request_id=state.request_id, trace_id=state.trace_id,
                  at=decode.name, reason=reason, uncached_tokens=uncached)  # fmt: skip
        decode.local_queued_tokens += uncached
        state.local_prefill = (decode, uncached)
        return decode

    def _local_prefilled(self, state: RequestState, answered: bool = True) -> None:
        """A request's first token came (``answered``; or it ended without one): its path's
        TTFT is measured (``PathModels``), and a local prefill's tokens leave its decode
        instance's local backlog."""
        choice = self._choices.pop(state.request_id, None)
        if choice is not None and answered:
            path, work, chosen = choice
            self.path_models.observe(path, work, self.clock() - chosen)
        if state.local_prefill is not None:
            link, num = state.local_prefill
            link.local_queued_tokens -= num
            state.local_prefill = None

    def _decodes_for(self, handle: p.KVHandle | None) -> list[Link]:
        """The decodes that can pull ``handle``'s blocks (none names its producer
        unreachable: a partition, links.py); every decode without a handle or when none can."""
        if handle is None:
            return self.decodes
        return decodes_reaching(handle.engine_id, self.decodes, time.monotonic(), self.peer_timeout)

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
