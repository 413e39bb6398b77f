"""Scheduler (pure): continuous batching with chunked prefill and prefix caching.

Each step it takes running decodes first, then waiting requests whose prompt KV was pulled
(one token each), then running prefill chunks (each group in arrival order), then admits
waiting requests while token budget, sequence slots and blocks allow. When the pool
runs dry mid-decode, the latest arrival is preempted: its blocks are freed and it is
recomputed later (its full blocks usually come back from the prefix cache). With a host
tier under the pool (common/engine/host_tier.py) a prompt's prefix may also come back from
host memory: those blocks are copied up at admission and count as cached tokens.

Each request has a block table per KV cache group (``groups``, common/engine/kv_groups.py;
common/engine/group_tables.py keeps them): in a sliding group, blocks that fall wholly
behind the window go back to the pool as the sequence advances; their table entries
become ``NULL_BLOCK``. Admission and preemption count the blocks of every group.

With ``num_speculative_tokens = k`` a running request in decode (one pending token) is
scheduled with ``k`` draft slots after that token (fewer only where max_tokens or
max_model_len leave less room, none when the token budget cannot take them), blocks
included; the engine writes the proposals into them (common/engine/spec_decode/). After the
verify, ``on_step_done`` counts only accepted positions as computed and frees blocks that
hold nothing but rejected drafts; full blocks are registered (hashed) only over accepted
tokens.

The scheduler owns every block its requests hold, and two states a service waits on:
a decode request whose prompt KV comes from a producer waits in
``WAITING_FOR_REMOTE_KV`` (``add_remote``): its service asks for the blocks the pull
lands in (``reserve_remote``, False while they are not free), then reports the pull done
(``remote_kv_arrived``: it joins the waiting queue with its prompt computed) or failed
(``remote_kv_failed``: the blocks come back). A prefilled request whose blocks a consumer
still has to pull is pinned (``pin``) until its lease ends (``unpin``). With
``publish_host_tier`` (a producer that serves its host tier), a pinned block the tier also
holds is published as its tier slot, pinned in the tier instead, and its device block goes
back to the pool at once.

The waiting line is served fairly (the Virtual Token Counter of "Fairness in Serving
Large Language Models", OSDI 2024): each client (``Request.client``, named by the router)
has a counter of the tokens steps computed for it here; the next request admitted is the
waiting one of the lowest ``priority`` (vLLM's: lower first), then of the client with the
lowest counter, then the first in line (arrival order, a preempted request back at the
front). A client that becomes active starts at the lowest counter among the active ones:
it neither jumps ahead on credit from an idle past nor waits for the others' history. One
client alone is served first come, first served, as before; running requests and
preemption (the latest arrival first) are untouched.

Decode steps (``fair``, common/engine/fair_batch.py): while more than one client has
sequences decoding, a step may take fewer of them than run, where the engine's measured
step times say a smaller step keeps the throughput (a CPU; never a GPU, whose curve does not
saturate): the seats go one to each client (the least served first), the rest by the
counters seat by seat, and a client's sequences by the turn they last ran in (the least
recent first), so the busy client's sequences rotate and none starves. A sequence left
out keeps its blocks and waits a step. Prefill chunks and admissions are as before.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from operator import attrgetter

from pdserve.common.engine.block_pool import BlockPool, hash_blocks
from pdserve.common.engine.fair_batch import DecodeCurve
from pdserve.common.engine.group_tables import GroupTables
from pdserve.common.engine.kv_groups import KVCacheGroup
from pdserve.common.engine.request import Request, Status
from pdserve.common.engine.step_plan import ScheduledSeq, StepPlan

ARRIVAL = attrgetter("arrival_order")  # the running line's order, each step
MAX_COUNTERS = 4096  # clients' counters kept; past it, those of idle clients are dropped


class Scheduler:
    def __init__(
        self,
        pool: BlockPool,
        block_size: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        group: KVCacheGroup | None = None,
        num_speculative_tokens: int = 0,
        max_model_len: int | None = None,
        groups: Sequence[KVCacheGroup] = (),
    ) -> None:
        self.pool = pool
        self.num_speculative_tokens = num_speculative_tokens
        self.max_model_len = max_model_len
        # ``group``: the one group of every layer (full attention when None); ``groups``:
        # the cache's groups, one block table each.
        self.groups = list(groups) or [group or KVCacheGroup(layers=())]
        self.tables = GroupTables(pool, self.groups, block_size)
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        # decode requests whose prompt KV is being pulled, or waits for blocks to land in
        self.waiting_for_remote_kv: dict[str, Request] = {}
        # prefill: finished requests whose blocks stay referenced until a consumer pulled
        self.pinned: dict[str, Request] = {}
        # prefill whose producer registered the host tier: ``pin`` publishes tier slots
        self.publish_host_tier = False
        self.pinned_slots: dict[str, list[int]] = {}  # request -> tier slots it pins
        self.num_preemptions = 0
        self.num_computed_tokens = 0  # every token computed by a step, for tests and stats
        # prompt tokens recomputed because a sliding window lost blocks of a cached prefix
        self.num_replayed_tokens = 0
        # tokens computed for requests then aborted (nobody waited for them; engine_core)
        self.num_abandoned_tokens = 0
        self.served: dict[str, int] = {}  # client -> tokens computed for it (its counter)
        # Fair decode batches (fair_batch.py): "auto" (the measured curve), "off", or a
        # fixed cap; the engine core feeds the curve with its decode steps' times.
        self.fair_decode_batch: str | int = "off"
        self.decode_curve = DecodeCurve(())
        self.decode_cap: int | None = None  # the last step's cap (None: every decode ran)
        self.decode_probe = False  # whether that cap was a probe's (fair_batch.py)
        self.decode_shared = False  # whether more than one client decoded in the last step
        self.num_turns = 0  # decode turns handed out, for the decodes' rotation

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, req: Request) -> None:
        self._activate(req)
        self.waiting.append(req)

    def _activate(self, req: Request) -> None:
        """Lift the counter of a client that had nothing here to the lowest of the active
        clients' (VTC): served from now on by what it is served from now on."""
        active = {r.client for r in self.running} | {r.client for r in self.waiting}
        active.update(r.client for r in self.waiting_for_remote_kv.values() if r is not req)
        if req.client in active:
            return
        if len(self.served) > MAX_COUNTERS:  # forget idle clients' counters
            self.served = {c: n for c, n in self.served.items() if c in active}
        floor = min((self.served.get(c, 0) for c in active), default=0)
        self.served[req.client] = max(self.served.get(req.client, 0), floor)

    def _next_waiting(self, line: Sequence[Request] | None = None) -> Request:
        """The waiting request (of ``line``, default: all) to admit next: lowest priority,
        then the client served fewest tokens, then the first in line."""
        line = self.waiting if line is None else line
        first = line[0]
        if all(r.client == first.client and r.priority == first.priority for r in line):
            return first
        served = self.served
        best = min(
            range(len(line)),
            key=lambda i: (line[i].priority, served.get(line[i].client, 0), i),
        )
        return line[best]

    def max_blocks(self, num_tokens: int, num_prompt_tokens: int) -> int:
        """The most blocks one request of ``num_tokens`` (prompt included) holds at once."""
        chunk = min(num_prompt_tokens, self.max_num_batched_tokens)
        return self.tables.max_blocks(num_tokens, chunk)

    def schedule(self) -> tuple[StepPlan, list[Request]]:
        """The next step: running decodes, then waiting requests whose prompt is computed
        (a pulled KV cache: one token each), then running prefill chunks, then waiting
        requests while token budget, sequence slots and blocks allow. Long prompts being
        prefilled here (or recomputed) thus never take the whole budget from streams that
        generate, so their token gaps stay one step long (before, running requests went in
        arrival order: a 4,000-token prompt on 2 CPU cores took each step's 2,048 tokens for
        a minute, past the router's token gap, and pulled requests waited behind it)."""
        budget = self.max_num_batched_tokens
        chosen: list[tuple[Request, int]] = []
        decodes: list[Request] = []
        prefills: list[Request] = []
        for req in sorted(self.running, key=ARRIVAL):
            (decodes if self._decoding(req) else prefills).append(req)
        decodes = self._fair_decodes(decodes)
        for req in decodes:
            budget = self._take_running(req, budget, chosen)
        ready = []
        if budget > 0 and len(self.running) < self.max_num_seqs:
            ready = [r for r in self.waiting if self._decoding(r) and not r.has_pending_token]
        while ready and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self._next_waiting(ready)  # fair among them too
            if not self._admit(req, budget, chosen):
                break
            ready.remove(req)
            budget -= chosen[-1][1]
        for req in prefills:
            budget = self._take_running(req, budget, chosen)
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self._next_waiting()
            if req.has_pending_token:
                break  # preempted while its newest token was on the device: not yet known
            if not self._admit(req, budget, chosen):
                break
            budget -= chosen[-1][1]
        # Single-token steps (decodes) first: the model runs them as one batched call.
        chosen.sort(key=lambda item: item[1] != 1)
        plan = StepPlan([self._scheduled(req, num) for req, num in chosen])
        return plan, [req for req, _ in chosen]

    def _fair_decodes(self, decodes: list[Request]) -> list[Request]:
        """The decodes that step now (all but where the fair cap engages; module
        docstring), in arrival order."""
        self.decode_cap = None
        self.decode_probe = False
        mode = self.fair_decode_batch
        n = len(decodes)
        self.decode_shared = n >= 2 and len({r.client for r in decodes}) >= 2
        if mode == "off" or not self.decode_shared:
            return decodes
        if isinstance(mode, int):
            limit: int | None = mode
        else:
            limit = self.decode_curve.probe(n)
            self.decode_probe = limit is not None
            if limit is None:
                limit = self.decode_curve.cap(n)
        picked = decodes
        if limit is not None and limit < n:
            self.decode_cap = limit
            picked = self._fair_pick(decodes, limit)
            chosen = set(map(id, picked))
            decodes = [r for r in decodes if id(r) in chosen]
        for req in picked:  # a turn each, in the order picked: a strict rotation
            self.num_turns += 1
            req.last_step = self.num_turns
        return decodes

    def _fair_pick(self, decodes: list[Request], limit: int) -> list[Request]:
        """``limit`` of ``decodes``: one seat per client, the least served first, then seat
        by seat to the client least served counting its seats so far; within a client the
        sequence that ran least recently first (then arrival)."""
        lines: dict[str, deque[Request]] = {}
        for req in sorted(decodes, key=lambda r: (r.last_step, r.arrival_order)):
            lines.setdefault(req.client, deque()).append(req)
        served = self.served
        given = {c: served.get(c, 0) for c in lines}
        picked: list[Request] = []
        for client in sorted(lines, key=lambda c: given[c])[:limit]:  # a seat each
            picked.append(lines[client].popleft())
            given[client] += 1
        while len(picked) < limit:
            client = min((c for c in lines if lines[c]), key=lambda c: given[c])
            picked.append(lines[client].popleft())
            given[client] += 1
        return picked

    def _take_running(self, req: Request, budget: int, chosen: list[tuple[Request, int]]) -> int:
        """Schedule running ``req``'s next tokens within ``budget``; the budget left."""
        if budget == 0 or req.status is not Status.RUNNING:  # preempted earlier this step
            return budget
        if req.has_pending_token and self._ends_at_pending(req):
            return budget  # its token on the device is its last (async_steps.py)
        req.num_drafts = self._num_drafts(req, budget)
        num = min(req.num_pending_tokens + req.num_drafts, budget)
        if not self._grow(req, num, chosen):
            req.num_drafts = 0
            return budget
        chosen.append((req, num))
        return budget - num

    def _admit(self, req: Request, budget: int, chosen: list[tuple[Request, int]]) -> bool:
        """Move waiting ``req`` into the running set with its first ``budget`` tokens (at
        most); False, and nothing changed, when the pool cannot hold them."""
        req.num_drafts = 0
        if not req.block_ids:
            self._take_cached_prefix(req)
        num = min(req.num_pending_tokens, budget)
        needed = self._blocks_needed(req, num)
        if needed > self.pool.num_free_blocks and self.pool.num_fenced:
            self.pool.settle()
        if needed > self.pool.num_free_blocks:
            # A waiting request holds no blocks, so running ones can always grow.
            self._release_blocks(req)
            return False
        self.tables.allocate(req, num)
        self.num_replayed_tokens += req.num_replayed_tokens
        if req is self.waiting[0]:
            self.waiting.popleft()
        else:
            self.waiting.remove(req)
        req.status = Status.RUNNING
        self.running.append(req)
        chosen.append((req, num))
        return True

    @staticmethod
    def _decoding(req: Request) -> bool:
        """Whether ``req`` is past its prompt: one token (and its drafts) a step."""
        return req.num_pending_tokens <= 1 and bool(req.output_token_ids)

    def _ends_at_pending(self, req: Request) -> bool:
        """Whether the token still on the device ends ``req`` by length: computing after
        it would be for nothing, and past max_model_len."""
        if len(req.output_token_ids) >= req.sampling.max_tokens:
            return True
        return self.max_model_len is not None and req.num_tokens >= self.max_model_len

    def _num_drafts(self, req: Request, budget: int) -> int:
        """Draft slots for ``req`` this step: k for a decoding request, fewer near its end."""
        k = self.num_speculative_tokens
        if not k or req.num_pending_tokens != 1 or not req.output_token_ids:
            return 0
        # The step emits at most drafts + 1 tokens and writes KV up to the last draft.
        room = req.sampling.max_tokens - len(req.output_token_ids) - 1
        if self.max_model_len is not None:
            room = min(room, self.max_model_len - req.num_tokens)
        num = max(0, min(k, room))
        return num if 1 + num <= budget else 0

    def _scheduled(self, req: Request, num: int) -> ScheduledSeq:
        start = req.num_computed_tokens
        real = num - req.num_drafts
        # the draft slots hold the last token until the engine fills them
        tokens = req.token_ids_between(start, start + real)
        tokens += tokens[-1:] * req.num_drafts
        top = req.sampling.prompt_logprobs
        # prompt logprobs: each computed position before the prompt's last scores the next
        next_ids = [] if top is None else req.prompt_token_ids[start + 1 : start + real + 1]
        return ScheduledSeq(
            req.request_id,
            tokens,
            start,
            list(req.block_ids),
            start + real == req.num_tokens,
            score_next_ids=next_ids,
            score_top=top or 0,
            num_drafts=req.num_drafts,
            group_block_ids=[list(t) for t in req.tables[1:]],
            block_copies=req.take_block_copies(),
        )

    def _blocks_needed(self, req: Request, num: int) -> int:
        return self.tables.blocks_needed(req, num)

    def _grow(self, req: Request, num: int, chosen: list[tuple[Request, int]]) -> bool:
        """Give ``req`` the blocks for ``num`` more tokens, preempting later arrivals."""
        needed = self._blocks_needed(req, num)
        if needed > self.pool.num_free_blocks and self.pool.num_fenced:
            self.pool.settle()  # blocks freed while the last step ran, before preempting
        while needed > self.pool.num_free_blocks:
            victim = max(
                (r for r in self.running if r.status is Status.RUNNING),
                key=lambda r: r.arrival_order,
            )
            if victim in (r for r, _ in chosen):
                # Everything after ``req`` is already scheduled this step; wait a step.
                return False
            self._preempt(victim)
            if victim is req:
                return False
        if needed:  # none: every table covers the tokens already (most decode steps)
            self.tables.allocate(req, num)
        return True

    def _take_cached_prefix(self, req: Request) -> None:
        self._extend_hashes(req)
        self.tables.ensure(req)
        if req.sampling.prompt_logprobs is not None:
            return  # every prompt position must be computed to be scored
        # The last token is always computed so that there are logits to sample from.
        max_blocks = (req.num_tokens - 1) // self.block_size
        hashes = req.block_hashes[:max_blocks]
        # host-tier hits come up into device blocks first (block_pool.hold_prefix)
        held = self.pool.hold_prefix(hashes) if self.pool.tier is not None else []
        num = self.tables.match(req, hashes)
        self.pool.drop(held)
        req.num_computed_tokens = num * self.block_size
        if req.num_cached_tokens == 0:
            req.num_cached_tokens = min(req.num_computed_tokens, req.num_prompt_tokens)
        self._drop_outside_window(req)

    def _drop_outside_window(self, req: Request) -> None:
        """Return the blocks no later query of ``req`` can see (sliding groups only)."""
        self.tables.drop_outside_window(req)

    def _extend_hashes(self, req: Request) -> None:
        done = len(req.block_hashes)
        num_full = req.num_tokens // self.block_size
        if done < num_full:
            parent = req.block_hashes[-1] if done else None
            tokens = req.token_ids_between(done * self.block_size, num_full * self.block_size)
            req.block_hashes += hash_blocks(tokens, self.block_size, parent)

    def _release_blocks(self, req: Request) -> None:
        self.tables.release(req)
        req.num_computed_tokens = 0
        req.num_registered_blocks = 0
        req.num_draft_computed = 0

    def _preempt(self, req: Request) -> None:
        self._release_blocks(req)
        req.status = Status.WAITING
        self.running.remove(req)
        self.waiting.appendleft(req)
        self.num_preemptions += 1

    def on_step_done(
        self, reqs: list[Request], plan: StepPlan, num_rejected: Sequence[int] = ()
    ) -> None:
        """Advance progress and make newly full blocks findable by later prompts.
        ``num_rejected``: per sequence, drafts the verify rejected (their KV is void: the
        positions are computed again, and blocks holding only them go back to the pool).
        A verify step is done before its accepted tokens are appended: blocks are
        registered only as far as the request's tokens reach."""
        rejected = list(num_rejected) or [0] * len(reqs)
        for req, seq, void in zip(reqs, plan.seqs, rejected, strict=True):
            req.num_computed_tokens += len(seq.token_ids) - void
            self.num_computed_tokens += len(seq.token_ids)
            req.num_step_tokens += len(seq.token_ids)
            self.served[req.client] = self.served.get(req.client, 0) + len(seq.token_ids)
            if void:
                self._free_tail(req)
            req.num_drafts = 0
            req.num_draft_computed = min(req.num_draft_computed, req.num_computed_tokens)
            num_full = min(req.num_computed_tokens, req.num_tokens) // self.block_size
            if num_full > req.num_registered_blocks:
                self._extend_hashes(req)
                self.tables.register(req, num_full)
                req.num_registered_blocks = num_full
            self._drop_outside_window(req)

    def _free_tail(self, req: Request) -> None:
        """Free the blocks past the last computed position (they held rejected drafts)."""
        self.tables.free_tail(req)

    # -- remote KV (decode) ---------------------------------------------------------------

    def add_remote(self, req: Request) -> None:
        """Hold ``req`` (``req.remote`` set) until its prompt KV has been pulled."""
        if req.remote is None:
            raise ValueError(f"{req.request_id}: no remote KV to wait for")
        req.status = Status.WAITING_FOR_REMOTE_KV
        self.waiting_for_remote_kv[req.request_id] = req

    def reserve_remote(self, req: Request) -> bool:
        """Allocate the blocks ``req``'s pull lands in; False while they are not free (the
        request keeps waiting: decodes finishing give them back)."""
        remote = req.remote
        assert remote is not None and req.status is Status.WAITING_FOR_REMOTE_KV
        if any(req.tables):
            raise RuntimeError(f"{req.request_id}: blocks for its pull already reserved")
        needed = self.tables.pulled_blocks_needed(remote.num_tokens, remote.first_blocks)
        if needed > self.pool.num_free_blocks:
            return False
        self.tables.reserve_pulled(req, remote.num_tokens, remote.first_blocks)
        if self.pool.tier is not None:
            self.pool.tier.flush()  # the pull writes the blocks from outside the stream
        return True

    def remote_kv_arrived(self, req: Request) -> None:
        """The pull into ``req``'s blocks is done: it waits for a step like any request,
        its prompt computed."""
        del self.waiting_for_remote_kv[req.request_id]
        req.num_computed_tokens = req.num_prompt_tokens
        req.status = Status.WAITING
        self._activate(req)
        self.waiting.append(req)

    def remote_kv_failed(self, req: Request, recompute: bool) -> None:
        """The pull failed (or never started): its blocks come back. ``recompute``: the
        request waits to compute its prompt here (``kv_load_failure_policy =
        "recompute"``); else it ends."""
        del self.waiting_for_remote_kv[req.request_id]
        if any(req.tables):
            self.tables.release(req)
        if recompute:
            req.status = Status.WAITING
            self.waiting.append(req)
        else:
            req.finish_reason = "abort"
            req.status = Status.FINISHED

    # -- pins (prefill) -------------------------------------------------------------------

    def pin(self, req: Request) -> tuple[list[int], list[int]]:
        """End ``req`` here but keep the blocks it holds until ``unpin``: a consumer pulls
        them (prefill's lease). Returns (block ids, host slots) as a KV handle lists them:
        group after group, entries before ``req.dropped[g]`` (left a sliding window) not
        among them; host slots empty, or per entry the tier slot serving it (block id -1)
        or -1 (``publish_host_tier``)."""
        self.running.remove(req)
        req.status = Status.FINISHED
        self.pinned[req.request_id] = req
        blocks = req.held_block_ids
        slots = self._pin_host_slots(req)
        if not slots:
            return blocks, []
        self.pinned_slots[req.request_id] = [s for s in slots if s >= 0]
        # The consumer reads these from the tier: their device blocks go back to the pool
        # now (still cached there), not at the lease's end. The table keeps the rest only,
        # what ``unpin`` frees.
        self.pool.free([b for b, s in zip(blocks, slots, strict=True) if s >= 0])
        req.tables[0] = [b for b, s in zip(blocks, slots, strict=True) if s < 0]
        return [-1 if s >= 0 else b for b, s in zip(blocks, slots, strict=True)], slots

    def _pin_host_slots(self, req: Request) -> list[int]:
        """Per held block, the tier slot now pinned for it or -1; empty when none is (the
        tier holds one full-attention group only, so one hash a block)."""
        tier = self.pool.tier
        if not self.publish_host_tier or tier is None or len(req.tables) != 1:
            return []
        slots = []
        for block in req.held_block_ids:
            hashes = self.pool.hashes_of(block)
            slot = tier.pin(hashes[0]) if hashes else None
            slots.append(-1 if slot is None else slot)
        return slots if max(slots, default=-1) >= 0 else []

    def unpin(self, request_id: str) -> bool:
        """Free a pinned request's blocks and tier slots; False when it holds none
        (unpinned already)."""
        req = self.pinned.pop(request_id, None)
        if req is None:
            return False
        self.tables.release(req)
        slots = self.pinned_slots.pop(request_id, [])
        if slots and self.pool.tier is not None:
            for slot in slots:
                self.pool.tier.unpin(slot)
        return True

    def finish(self, req: Request, reason: str) -> None:
        req.finish_reason = reason
        if req.status is Status.RUNNING:
            self.running.remove(req)
        elif req.status is Status.WAITING:
            self.waiting.remove(req)
        elif req.status is Status.WAITING_FOR_REMOTE_KV:
            del self.waiting_for_remote_kv[req.request_id]
        req.status = Status.FINISHED
        if any(req.tables):
            self.tables.release(req)
