"""Scheduler without a model: chunking, budgets, prefix hits, preemption, block return."""

import random

from pdserve.common.engine.block_pool import BlockPool
from pdserve.common.engine.request import Request, Status
from pdserve.common.engine.sampling import SamplingParams
from pdserve.common.engine.scheduler import Scheduler

B = 4


def make(num_blocks: int = 32, max_seqs: int = 8, budget: int = 16) -> Scheduler:
    return Scheduler(BlockPool(num_blocks), B, max_seqs, budget)


def run_to_end(s: Scheduler, reqs: list[Request], max_tokens: int) -> int:
    """Drive steps with a fake sampler (token = step number); return the number of steps."""
    steps = 0
    while s.has_unfinished:
        plan, chosen = s.schedule()
        assert plan.seqs, "no progress"
        assert plan.num_tokens <= s.max_num_batched_tokens
        for seq, req in zip(plan.seqs, chosen, strict=True):
            assert seq.start_position == req.num_computed_tokens
            assert len(req.block_ids) * B >= seq.context_len
        s.on_step_done(chosen, plan)
        for seq, req in zip(plan.seqs, chosen, strict=True):
            if seq.sample:
                req.output_token_ids.append(1000 + steps)
                if len(req.output_token_ids) >= max_tokens:
                    s.finish(req, "length")
        steps += 1
    return steps


def test_chunked_prefill_respects_the_token_budget() -> None:
    s = make(budget=6)
    req = Request("a", list(range(14)), SamplingParams())
    s.add(req)
    plan, _ = s.schedule()
    assert [len(x.token_ids) for x in plan.seqs] == [6] and not plan.seqs[0].sample
    s.on_step_done([req], plan)
    plan, _ = s.schedule()
    s.on_step_done([req], plan)
    plan, _ = s.schedule()
    assert plan.seqs[0].token_ids == list(range(12, 14)) and plan.seqs[0].sample


def test_decodes_come_first_and_all_blocks_return() -> None:
    s = make()
    reqs = [Request(str(i), list(range(3 + 5 * i)), SamplingParams(), i) for i in range(5)]
    for r in reqs:
        s.add(r)
    run_to_end(s, reqs, max_tokens=7)
    assert all(r.status is Status.FINISHED and len(r.output_token_ids) == 7 for r in reqs)
    assert s.pool.num_free_blocks == s.pool.num_blocks


def test_prefix_hit_skips_cached_blocks_but_always_computes_the_last_token() -> None:
    s = make()
    first = Request("a", list(range(12)), SamplingParams())
    s.add(first)
    run_to_end(s, [first], max_tokens=1)
    second = Request("b", list(range(12)), SamplingParams())
    s.add(second)
    plan, _ = s.schedule()
    # 12 tokens = 3 full blocks; only 2 may come from the cache so one token is computed.
    assert second.num_cached_tokens == 8 and plan.seqs[0].start_position == 8
    s.finish(second, "abort")
    assert s.pool.num_free_blocks == s.pool.num_blocks


def test_preemption_under_block_pressure_finishes_everything() -> None:
    s = make(num_blocks=10, max_seqs=8, budget=64)
    rng = random.Random(0)
    reqs = [
        Request(str(i), [rng.randrange(50) for _ in range(rng.randint(1, 12))], SamplingParams(), i)
        for i in range(8)
    ]
    for r in reqs:
        s.add(r)
    run_to_end(s, reqs, max_tokens=20)
    assert s.num_preemptions > 0
    assert all(len(r.output_token_ids) == 20 for r in reqs)
    assert s.pool.num_free_blocks == s.pool.num_blocks


def test_max_num_seqs_bounds_the_running_set() -> None:
    s = make(max_seqs=2)
    for i in range(4):
        s.add(Request(str(i), [1, 2], SamplingParams(), i))
    plan, _ = s.schedule()
    assert len(plan.seqs) == 2 and len(s.waiting) == 2


def test_token_ids_between_is_a_slice_of_all_token_ids() -> None:
    req = Request("a", list(range(10)), SamplingParams())
    req.output_token_ids += [100, 101, 102]
    whole = req.all_token_ids
    for start in range(14):
        for stop in range(start, 15):
            assert req.token_ids_between(start, stop) == whole[start:stop], (start, stop)


def test_the_scheduler_owns_remote_kv_blocks_and_pins() -> None:
    from pdserve.common.engine.request import RemoteKV

    s = make(num_blocks=6)
    reqs = []
    for rid in ("a", "b"):
        req = Request(rid, list(range(14)), SamplingParams())
        req.remote = RemoteKV(num_tokens=14, first_blocks=(0,), first_token=7)
        s.add_remote(req)
        reqs.append(req)
    a, b = reqs
    assert s.reserve_remote(a) and not s.reserve_remote(b)  # 4 of 6 blocks: b waits
    assert a.status is Status.WAITING_FOR_REMOTE_KV and not s.has_unfinished
    s.remote_kv_failed(a, recompute=False)  # its blocks come back: b's pull can land
    assert s.reserve_remote(b) and s.pool.num_free_blocks == 2
    s.remote_kv_arrived(b)
    assert s.waiting_for_remote_kv == {} and b.num_computed_tokens == 14
    b.output_token_ids.append(7)  # the producer's first token (DecodeEngine.pulled)
    plan, _ = s.schedule()  # b's first decode: its prompt is computed
    assert plan.seqs[0].start_position == 14 and plan.seqs[0].token_ids == [7]
    s.on_step_done([b], plan)
    assert s.pin(b) == (b.held_block_ids, []) and s.pool.num_free_blocks == 2
    assert s.unpin("b") and not s.unpin("b")  # freed once
    assert s.pool.num_free_blocks == 6


def test_long_prefills_never_take_the_budget_from_decodes_or_pulled_requests() -> None:
    """A long prompt prefilled here (arrived first, budget 8 a step) beside a request
    already decoding and one whose prompt KV was pulled: every step carries the decode's
    token, the pulled request starts decoding at once, and the long prompt gets the rest
    of the budget (before: running requests in arrival order, the long prompt's chunks
    took all 8 tokens until it was done; the others' token gaps grew with its length)."""
    from pdserve.common.engine.request import RemoteKV

    s = make(num_blocks=64, budget=8)
    long = Request("long", list(range(40)), SamplingParams(), 0)
    s.add(long)
    plan, _ = s.schedule()
    assert [len(x.token_ids) for x in plan.seqs] == [8]
    s.on_step_done([long], plan)
    short = Request("short", list(range(3)), SamplingParams(), 1)
    pulled = Request("pulled", list(range(6)), SamplingParams(), 2)
    pulled.remote = RemoteKV(num_tokens=6, first_blocks=(0,), first_token=7)
    s.add(short)
    s.add_remote(pulled)
    # short: admitted after long's chunk took the budget only once long is done, unless
    # decodes go first; here it waits one step, then decodes every step
    plan, chosen = s.schedule()
    s.on_step_done(chosen, plan)
    assert s.reserve_remote(pulled)
    s.remote_kv_arrived(pulled)
    pulled.output_token_ids.append(7)
    for seq, req in zip(plan.seqs, chosen, strict=True):
        if seq.sample:
            req.output_token_ids.append(1)
    seen: dict[str, int] = {"long": 0, "short": 0, "pulled": 0}
    for _ in range(3):
        plan, chosen = s.schedule()
        ids = [x.request_id for x in plan.seqs]
        assert "pulled" in ids and "long" in ids
        if short.output_token_ids:
            assert "short" in ids  # decoding: its token every step
        assert plan.num_tokens <= 8
        s.on_step_done(chosen, plan)
        for seq, req in zip(plan.seqs, chosen, strict=True):
            seen[req.request_id] += len(seq.token_ids)
            if seq.sample:
                req.output_token_ids.append(1)
    assert seen["pulled"] == 3 and seen["long"] >= 3 * (8 - 2)
