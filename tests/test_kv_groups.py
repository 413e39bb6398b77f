"""KV cache groups of a model mixing full and sliding layers: the page split, the allocator
(a block table per group over one pool), bounded replay and bounded memory."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdserve.common.engine.block_pool import BlockPool, hash_blocks
from pdserve.common.engine.kv_groups import (
    NULL_BLOCK,
    KVCacheGroup,
    group_hash,
    page_groups,
    page_layers,
)
from pdserve.common.engine.request import RemoteKV, Request, Status
from pdserve.common.engine.sampling import SamplingParams
from pdserve.common.engine.scheduler import Scheduler
from pdserve.common.model.decoder import layer_slots

B = 4
FULL = KVCacheGroup(layers=(0, 1))


def sliding(window: int) -> KVCacheGroup:
    return KVCacheGroup(layers=(2, 3), sliding_window=window)


def test_layers_split_into_groups_of_equal_pages() -> None:
    groups = page_groups([None, None, 16, 16])
    assert groups == [FULL, sliding(16)] and page_layers(groups) == 2
    assert layer_slots([g.layers for g in groups], 4) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    # 3 full + 1 sliding: pages of one layer, the full kind in three groups
    groups = page_groups([None, 8, None, None])
    assert [g.layers for g in groups] == [(0,), (2,), (3,), (1,)]
    assert page_layers(groups) == 1 and layer_slots([g.layers for g in groups], 4)[1] == (3, 0)
    # 3 full + 2 sliding: pages of two layers, the last full group uses one slot
    groups = page_groups([None, None, None, 8, 8])
    assert [g.layers for g in groups] == [(0, 1), (2,), (3, 4)]
    assert page_layers(groups) == 2
    # one kind: one group of every layer, as before groups were split
    assert page_groups([None] * 3) == [KVCacheGroup(layers=(0, 1, 2))]
    assert page_groups([8, 8]) == [KVCacheGroup(layers=(0, 1), sliding_window=8)]


@pytest.mark.parametrize("window", [1, 4, 7, 13])
def test_a_mixed_model_bounds_its_sliding_group_while_the_full_group_grows(window: int) -> None:
    groups = [FULL, sliding(window)]
    pool = BlockPool(256)
    s = Scheduler(pool, B, max_num_seqs=4, max_num_batched_tokens=5, groups=groups)
    reqs = [Request(str(i), list(range(3 + 9 * i)), SamplingParams(), i) for i in range(4)]
    for r in reqs:
        s.add(r)
    steps = 0
    while s.has_unfinished:
        plan, chosen = s.schedule()
        assert plan.seqs
        for seq, req in zip(plan.seqs, chosen, strict=True):
            assert len(seq.group_block_ids) == 1
            full_table, slide_table = seq.block_ids, seq.table(1)
            num_entries = -(-seq.context_len // B)
            assert len(full_table) == len(slide_table) == num_entries
            assert NULL_BLOCK not in full_table  # the full group keeps every block
            first = max(seq.start_position - window + 1, 0) // B
            assert NULL_BLOCK not in slide_table[first:]  # what the queries see is real
            held = req.held_of_group(1)
            assert len(held) <= groups[1].max_blocks(seq.context_len, B, len(seq.token_ids))
            assert not set(full_table) & set(held)  # one pool, distinct blocks per group
        s.on_step_done(chosen, plan)
        for seq, req in zip(plan.seqs, chosen, strict=True):
            if seq.sample:
                req.output_token_ids.append(1000 + steps)
                # decoding: the sliding group holds ceil(W / B) + 1 blocks at most
                assert len(req.held_of_group(1)) <= -(-window // B) + 1
                assert len(req.held_of_group(0)) == -(-req.num_computed_tokens // B)
                if len(req.output_token_ids) >= 40:
                    s.finish(req, "length")
        steps += 1
    assert all(r.status is Status.FINISHED for r in reqs)
    assert pool.num_free_blocks == pool.num_blocks
    assert all(pool.ref_count(b) == 0 for b in range(pool.num_blocks))


def test_admission_counts_every_group() -> None:
    pool = BlockPool(64)
    s = Scheduler(pool, B, 4, 64, groups=[FULL, sliding(8)])
    # 40 tokens: 10 full blocks + ceil((8 - 1 + 40) / 4) + 1 = 13 -> capped at 10
    assert s.max_blocks(40, 40) == 20
    assert s.max_blocks(400, 40) == 100 + 13
    assert Scheduler(pool, B, 4, 64, groups=[FULL]).max_blocks(400, 40) == 100


def test_preempting_a_mixed_request_releases_both_groups() -> None:
    pool = BlockPool(64)
    s = Scheduler(pool, B, max_num_seqs=2, max_num_batched_tokens=64, groups=[FULL, sliding(4)])
    req = Request("a", list(range(30)), SamplingParams())
    s.add(req)
    plan, chosen = s.schedule()
    s.on_step_done(chosen, plan)
    assert req.dropped == [0, 6] and req.tables[1][:6] == [NULL_BLOCK] * 6
    assert pool.num_blocks - pool.num_free_blocks == 8 + 2
    s._preempt(req)
    assert pool.num_free_blocks == pool.num_blocks and req.dropped == [0, 0]


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


def test_a_mixed_prefix_hit_needs_the_full_group_and_the_window() -> None:
    pool = BlockPool(128)
    s = Scheduler(pool, B, max_num_seqs=4, max_num_batched_tokens=64, groups=[FULL, sliding(8)])
    prompt = list(range(40))  # 10 blocks; a rerun resumes at most at block 9 (36)
    first = Request("a", prompt, SamplingParams())
    assert _prefill(s, first) == 0
    hashes = first.block_hashes
    s.finish(first, "length")
    # the sliding group's blocks behind the window of 36 are not needed
    assert all(pool.evict(group_hash(hashes[i], 1)) for i in range(5))
    again = Request("b", prompt, SamplingParams())
    assert _prefill(s, again) == 36 and again.num_cached_tokens == 36
    assert again.tables[1][:7] == [NULL_BLOCK] * 7 and NULL_BLOCK not in again.block_ids
    assert s.num_replayed_tokens == 0
    s.finish(again, "length")
    # a sliding block inside the window lost: cut back to 28, at most W replayed
    assert pool.evict(group_hash(hashes[7], 1))
    third = Request("c", prompt, SamplingParams())
    assert _prefill(s, third) == 28
    assert s.num_replayed_tokens == 8 == third.num_replayed_tokens
    s.finish(third, "length")
    # a full group's block lost: the hit ends before it (the window of 32 is cached:
    # the third run recomputed block 7), nothing counted as replayed
    assert pool.evict(hashes[8])
    fourth = Request("d", prompt, SamplingParams())
    assert _prefill(s, fourth) == 32 and fourth.num_replayed_tokens == 0
    s.finish(fourth, "length")
    assert pool.num_free_blocks == pool.num_blocks


def _mixed_model(tmp_path: Path, window: int, layers: int = 2) -> Path:
    """Qwen2 with ``max_window_layers = layers // 2``: the first half full, the rest sliding."""
    from pdserve.common.model.fixtures.random import save_random_model

    return save_random_model(
        tmp_path / "qwen2-mix",
        "qwen2",
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=layers,
        use_sliding_window=True,
        sliding_window=window,
        max_window_layers=layers // 2,
        max_position_embeddings=4096,
        vocab_size=2048,
    )


@pytest.mark.slow
def test_a_long_generation_on_a_mixed_model_keeps_its_sliding_group_bounded(
    tmp_path: Path, model_dir: Path
) -> None:
    """1 full + 1 sliding layer (W = 64, blocks of 16): over a 1,000-token generation the
    pool (``pdserve:kv_blocks_free``) holds the full group's ceil(n / 16) blocks plus at
    most ceil(64 / 16) + 1 = 5 of the sliding group's, never a block per token of it."""
    pytest.importorskip("transformers")
    from pdserve.common.engine.config import EngineConfig
    from pdserve.common.engine.llm_engine import LLMEngine
    from pdserve.common.runtime.engine_thread import report_engine
    from pdserve.common.runtime.metrics import Metrics

    path = _mixed_model(tmp_path, window=64)
    engine = LLMEngine(EngineConfig(model=str(path), block_size=16, num_kv_blocks=80))
    assert [g.sliding_window for g in engine.kv_groups] == [None, 64]
    assert engine.runner.layout.num_layers == 1  # a block holds one group's one layer
    prompt = list(range(1000, 1008))
    engine.add_request("long", prompt, SamplingParams(max_tokens=1000, ignore_eos=True))
    metrics = Metrics("decode", "test")
    excess = []
    while engine.has_unfinished:
        engine.step()
        report_engine(metrics, engine, 0, 0)
        held = engine.pool.num_blocks - int(metrics.value("pdserve:kv_blocks_free"))
        req = engine.scheduler.running[0] if engine.scheduler.running else None
        if req is not None:
            excess.append(held - -(-req.num_computed_tokens // 16))
    assert max(excess) == 5  # the sliding group's bound, reached
    assert metrics.value("pdserve:kv_blocks_free") == engine.pool.num_blocks


@pytest.mark.slow
def test_bounded_replay_on_a_mixed_model_gives_the_same_tokens(
    tmp_path: Path, model_dir: Path
) -> None:
    pytest.importorskip("transformers")
    from pdserve.common.engine.config import EngineConfig
    from pdserve.common.engine.llm_engine import LLMEngine

    path = _mixed_model(tmp_path, window=32, layers=4)
    engine = LLMEngine(EngineConfig(model=str(path), block_size=16, num_kv_blocks=64))
    prompt = [(7 * i) % 2000 + 1 for i in range(200)]  # 12 full blocks, resumes at 192
    sampling = SamplingParams(max_tokens=8, ignore_eos=True)
    want = engine.generate([prompt], sampling)[0].token_ids
    hashes = hash_blocks(prompt, 16)
    # the sliding group's window of 192 is blocks 10 and 11; lose block 10
    assert engine.pool.evict(group_hash(hashes[10], 1))
    before = engine.scheduler.num_computed_tokens
    [again] = engine.generate([prompt], sampling)
    assert again.token_ids == want
    assert engine.scheduler.num_replayed_tokens == 32  # two blocks: <= W
    assert engine.scheduler.num_computed_tokens - before == (200 - 160) + 7
    assert again.num_cached_tokens == 160


LAYER_MIXES = {
    # three full groups of one layer and one sliding group: pages of one layer
    "F-S-F-F": ["full_attention", "sliding_attention", "full_attention", "full_attention"],
    # pages of two layers; the second full group leaves a slot unused
    "F-F-F-S-S": ["full_attention"] * 3 + ["sliding_attention"] * 2,
}


@pytest.mark.slow
@pytest.mark.parametrize("mix", sorted(LAYER_MIXES))
def test_uneven_mixes_give_transformers_tokens(tmp_path: Path, model_dir: Path, mix: str) -> None:
    """Qwen2 ``layer_types`` of uneven kinds, W = 8 over 4-token blocks and 16-token prefill
    chunks: the engine's greedy tokens equal transformers' (fp32, CPU)."""
    transformers = pytest.importorskip("transformers")
    import torch

    from pdserve.common.engine.config import EngineConfig
    from pdserve.common.engine.llm_engine import LLMEngine
    from pdserve.common.model.fixtures.random import save_random_model

    types = LAYER_MIXES[mix]
    path = save_random_model(
        tmp_path / mix,
        "qwen2",
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=len(types),
        layer_types=types,
        use_sliding_window=True,
        sliding_window=8,
        max_position_embeddings=1024,
        vocab_size=2048,
    )
    prompts = [[(5 * i + 3 * n) % 2000 + 1 for i in range(n)] for n in (3, 21, 70)]
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    want = []
    with torch.inference_mode():
        for ids in prompts:
            gen = hf.generate(
                torch.tensor([ids]), max_new_tokens=12, do_sample=False, top_p=None, top_k=None
            )
            want.append(gen[0, len(ids) :].tolist())
    config = EngineConfig(
        model=str(path), block_size=4, num_kv_blocks=400, max_num_batched_tokens=16
    )
    engine = LLMEngine(config)
    groups = engine.kv_groups
    assert len(groups) == (4 if mix == "F-S-F-F" else 3)
    outs = engine.generate(prompts, SamplingParams(max_tokens=12, ignore_eos=True))
    assert [o.token_ids for o in outs] == want
    assert engine.pool.num_free_blocks == engine.pool.num_blocks


@pytest.mark.slow
def test_ngram_speculation_on_a_mixed_model_keeps_its_tokens(
    tmp_path: Path, model_dir: Path
) -> None:
    """Verify steps carry every group's table: ngram drafts on the Qwen2 mix give the
    tokens of plain decoding."""
    pytest.importorskip("transformers")
    from pdserve.common.engine.config import EngineConfig
    from pdserve.common.engine.llm_engine import LLMEngine
    from pdserve.common.engine.spec_decode.config import SpeculativeConfig

    path = _mixed_model(tmp_path, window=8, layers=4)
    prompts = [[1, 2, 3, 4, 5, 6] * 6, [9, 8, 7] * 9 + [1, 2]]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    tokens = []
    ngram = SpeculativeConfig(method="ngram", num_speculative_tokens=3, prompt_lookup_min=2)
    for spec in (None, ngram):
        engine = LLMEngine(
            EngineConfig(model=str(path), block_size=4, num_kv_blocks=200, speculative_config=spec)
        )
        tokens.append([o.token_ids for o in engine.generate(prompts, params)])
        assert engine.pool.num_free_blocks == engine.pool.num_blocks
        if spec is not None:  # drafts were verified, and some accepted
            assert engine.speculator is not None
            assert engine.speculator.stats.num_accepted_tokens > 0
    assert tokens[0] == tokens[1]


def test_a_pulled_handle_splits_into_each_groups_table() -> None:
    from pdserve.common.engine.kv_groups import num_pulled_blocks, tables_of_pulled

    # 10 tokens in blocks of 4: 3 entries; the full group keeps all, the sliding one from 2
    assert num_pulled_blocks(10, B, [0, 2]) == 3 + 1
    assert tables_of_pulled([5, 6, 7, 9], 10, B, [0, 2]) == [[5, 6, 7], [NULL_BLOCK] * 2 + [9]]
    with pytest.raises(ValueError, match="5 blocks for tables that hold 4"):
        tables_of_pulled([5, 6, 7, 9, 11], 10, B, [0, 2])


def test_the_boundary_counts_every_groups_blocks() -> None:
    import msgspec

    from pdserve.common.runtime import boundary as b
    from tests.test_boundary import LIMITS, decode, handle

    two_groups = handle(block_ids=[3, 4, 5], group_first_blocks=[1])  # 2 entries + 1
    assert b.check(decode(handle=two_groups), LIMITS) is None
    short = msgspec.structs.replace(two_groups, block_ids=[3, 4])
    problem = b.check(decode(handle=short), LIMITS)
    assert problem is not None and "from table entries [0, 1]" in problem
    past = handle(block_ids=[3, 4], group_first_blocks=[3])
    problem = b.check(decode(handle=past), LIMITS)
    assert problem is not None and "first_block 3 is past its 2 entries" in problem


def test_a_decode_refuses_a_handle_of_another_group_count(tmp_path: Path, model_dir: Path) -> None:
    from pdserve.common.engine.config import EngineConfig
    from pdserve.common.errors import RequestError
    from pdserve.common.model.fixtures.random import save_random_llama
    from pdserve.services.decode.decode_engine import DecodeEngine

    path = save_random_llama(tmp_path / "llama", hidden_size=64, num_heads=4, num_kv_heads=2,
                             intermediate_size=128, vocab_size=2048)  # fmt: skip
    engine = DecodeEngine(EngineConfig(model=str(path), block_size=B, num_kv_blocks=32))
    prompt, params = list(range(10)), SamplingParams(max_tokens=2)
    engine.add_remote("a", prompt, params, RemoteKV(10, (0,), first_token=1))
    assert engine.reserve_remote("a") == [0, 1, 2]
    engine.add_remote("b", prompt, params, RemoteKV(10, (0, 2), first_token=1))
    with pytest.raises(RequestError, match="blocks of 2 KV cache groups but this decode's cache"):
        engine.reserve_remote("b")
    assert engine.pull_failed("b", recompute=False) is None
    engine.abort("a")
    assert engine.pool.num_free_blocks == 32
