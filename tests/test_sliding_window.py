"""Sliding-window KV with bounded memory: groups, the allocator, and a long generation."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdserve.common.engine.block_pool import BlockPool, hash_blocks
from pdserve.common.engine.kv_groups import NULL_BLOCK, KVCacheGroup, kv_cache_groups
from pdserve.common.engine.request import Request, Status
from pdserve.common.engine.sampling import SamplingParams
from pdserve.common.engine.scheduler import Scheduler

B = 4


def test_groups_by_attention_kind() -> None:
    full, sliding = kv_cache_groups([None, None, 16, 16])
    assert full == KVCacheGroup(layers=(0, 1)) and not full.is_sliding
    assert sliding == KVCacheGroup(layers=(2, 3), sliding_window=16)
    assert kv_cache_groups([8, 8]) == [KVCacheGroup(layers=(0, 1), sliding_window=8)]
    # W = 8, B = 4: the next query at 11 sees keys 4..11, so block 0 (0..3) is out
    assert sliding.num_blocks_outside(10, B) == 0  # query 10 sees key 3
    assert KVCacheGroup(layers=(0,), sliding_window=8).num_blocks_outside(11, B) == 1
    assert full.num_blocks_outside(10_000, B) == 0
    assert KVCacheGroup(layers=(0,), sliding_window=8).max_blocks(10_000, B) == 3  # ceil(8/4)+1
    assert KVCacheGroup(layers=(0,), sliding_window=8).max_blocks(6, B) == 2
    assert KVCacheGroup(layers=(0,), sliding_window=8).max_blocks(10_000, B, chunk=9) == 5


@pytest.mark.parametrize("window", [1, 3, 4, 8, 13])
def test_a_sliding_group_holds_at_most_its_bound_and_returns_every_block(window: int) -> None:
    group = KVCacheGroup(layers=(0,), sliding_window=window)
    pool = BlockPool(64)
    s = Scheduler(pool, B, max_num_seqs=4, max_num_batched_tokens=5, group=group)
    reqs = [Request(str(i), list(range(3 + 7 * i)), SamplingParams(), i) for i in range(4)]
    for r in reqs:
        s.add(r)
    steps = 0
    while s.has_unfinished:
        plan, chosen = s.schedule()
        assert plan.seqs
        for seq, req in zip(plan.seqs, chosen, strict=True):
            # every block the step's queries can see is a real one
            first = max(seq.start_position - window + 1, 0) // B
            needed = seq.block_ids[first : -(-seq.context_len // B)]
            assert NULL_BLOCK not in needed
            held = req.held_block_ids
            assert NULL_BLOCK not in held
            bound = group.max_blocks(seq.context_len, B, len(seq.token_ids))
            assert len(held) <= bound, (req, window)
        s.on_step_done(chosen, plan)
        for seq, req in zip(plan.seqs, chosen, strict=True):
            if seq.sample:
                req.output_token_ids.append(1000 + steps)
                # decoding: ceil(W / B) + 1 blocks at most, whatever the length
                assert len(req.held_block_ids) <= -(-window // B) + 1
                if len(req.output_token_ids) >= 40:
                    s.finish(req, "length")
        steps += 1
    assert all(r.status is Status.FINISHED for r in reqs)
    assert pool.num_free_blocks == pool.num_blocks
    assert all(pool.ref_count(b) == 0 for b in range(pool.num_blocks))


def test_a_full_group_drops_nothing() -> None:
    pool = BlockPool(64)
    s = Scheduler(pool, B, max_num_seqs=1, max_num_batched_tokens=64)
    req = Request("a", list(range(30)), SamplingParams())
    s.add(req)
    plan, chosen = s.schedule()
    s.on_step_done(chosen, plan)
    assert req.num_dropped_blocks == 0 and len(req.held_block_ids) == 8


def test_preempted_sliding_request_releases_what_it_holds() -> None:
    group = KVCacheGroup(layers=(0,), sliding_window=4)
    pool = BlockPool(64)
    s = Scheduler(pool, B, max_num_seqs=2, max_num_batched_tokens=64, group=group)
    req = Request("a", list(range(30)), SamplingParams())
    s.add(req)
    plan, chosen = s.schedule()
    s.on_step_done(chosen, plan)
    assert req.num_dropped_blocks == 6 and req.block_ids[:6] == [NULL_BLOCK] * 6
    assert pool.num_blocks - pool.num_free_blocks == 2
    s._preempt(req)
    assert pool.num_free_blocks == pool.num_blocks and req.num_dropped_blocks == 0


@pytest.mark.slow
def test_a_4k_token_generation_on_a_window_64_model_stays_in_its_bound(
    tmp_path: Path, model_dir: Path
) -> None:
    """Every layer windowed (Mistral): a cache of 6 blocks of 16 tokens (96 tokens) runs a
    4k-token generation, never holding more than ceil(64 / 16) + 1 = 5 blocks."""
    pytest.importorskip("transformers")
    from pdserve.common.engine.config import EngineConfig
    from pdserve.common.engine.llm_engine import LLMEngine
    from pdserve.common.model.fixtures.random import save_random_model

    path = save_random_model(
        tmp_path / "mistral",
        "mistral",
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=2,
        num_key_value_heads=1,
        num_hidden_layers=1,
        sliding_window=64,
        max_position_embeddings=8192,
        vocab_size=2048,  # a small head: 4k steps in less time
    )
    engine = LLMEngine(EngineConfig(model=str(path), block_size=16, num_kv_blocks=6))
    prompt = list(range(1000, 1008))  # validated against ceil((64 - 1 + 8) / 16) + 1 = 6
    engine.add_request("long", prompt, SamplingParams(max_tokens=4096, ignore_eos=True))
    most_held = 0
    num_tokens = 0
    while engine.has_unfinished:
        for out in engine.step():
            num_tokens += len(out.new_token_ids)
        most_held = max(most_held, engine.pool.num_blocks - engine.pool.num_free_blocks)
    assert num_tokens == 4096
    assert most_held == 5
    assert engine.pool.num_free_blocks == engine.pool.num_blocks


def _prefill(s: Scheduler, req: Request) -> int:
    """Schedule ``req`` to its first sampled token; the position its first step started at."""
    s.add(req)
    plan, chosen = s.schedule()
    start = plan.seqs[0].start_position
    while True:
        s.on_step_done(chosen, plan)
        if plan.seqs[0].sample:
            return start
        plan, chosen = s.schedule()


def test_a_prefix_hit_needs_only_the_window_and_replays_at_most_it() -> None:
    group = KVCacheGroup(layers=(0,), sliding_window=8)
    pool = BlockPool(64)
    s = Scheduler(pool, B, max_num_seqs=4, max_num_batched_tokens=64, group=group)
    prompt = list(range(40))  # 10 blocks; a rerun resumes at most at block 9 (36)
    first = Request("a", prompt, SamplingParams())
    assert _prefill(s, first) == 0
    hashes = first.block_hashes
    s.finish(first, "length")
    # Blocks behind the window go first; the window of 36 is blocks 7 and 8.
    assert all(pool.evict(hashes[i]) for i in range(5))
    again = Request("b", prompt, SamplingParams())
    assert _prefill(s, again) == 36 and again.num_cached_tokens == 36
    assert again.block_ids[:7] == [NULL_BLOCK] * 7 and s.num_replayed_tokens == 0
    s.finish(again, "length")
    # A block inside the window lost: cut back to 28, whose window (blocks 5, 6) is whole.
    assert pool.evict(hashes[7])
    third = Request("c", prompt, SamplingParams())
    assert _prefill(s, third) == 28
    assert s.num_replayed_tokens == 8 == third.num_replayed_tokens  # <= W
    s.finish(third, "length")
    assert pool.num_free_blocks == pool.num_blocks


@pytest.mark.slow
def test_bounded_replay_gives_the_same_tokens(tmp_path: Path, model_dir: Path) -> None:
    pytest.importorskip("transformers")
    from pdserve.common.engine.config import EngineConfig
    from pdserve.common.engine.llm_engine import LLMEngine
    from pdserve.common.model.fixtures.random import save_random_model

    path = save_random_model(
        tmp_path / "mistral",
        "mistral",
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=2,
        sliding_window=32,
        vocab_size=2048,
    )
    engine = LLMEngine(EngineConfig(model=str(path), block_size=16, num_kv_blocks=64))
    prompt = [(7 * i) % 2000 + 1 for i in range(200)]  # 12 full blocks, resumes at 192
    sampling = SamplingParams(max_tokens=8, ignore_eos=True)
    want = engine.generate([prompt], sampling)[0].token_ids
    hashes = hash_blocks(prompt, 16)  # the first run's, recomputed the same way
    # the window of 192 is blocks 10 and 11 (positions 161..191); lose block 10
    assert engine.pool.evict(hashes[10])
    before = engine.scheduler.num_computed_tokens
    [again] = engine.generate([prompt], sampling)
    assert again.token_ids == want
    assert engine.scheduler.num_replayed_tokens == 32  # two blocks: <= W
    # the prompt from 160 (cut back to where the window is whole), then 7 decodes
    assert engine.scheduler.num_computed_tokens - before == (200 - 160) + 7
    assert again.num_cached_tokens == 160
