"""DeepSeek-V4 against Hugging Face transformers, token for token (CPU, float32).

The checkpoint is built by transformers' own ``DeepseekV4Config`` and
``DeepseekV4ForCausalLM`` (random weights; the parameters transformers initialises to zero
or to a constant, the hash-routing table, sinks, compressor position biases, routing
biases and hyper-connection biases, drawn at random too, so each path matters) with every
kind of layer: sliding, CSA (entries of 4, two overlapping series, a lightning indexer
keeping 6) and HCA (entries of 16 here), hash_moe and moe layers, 4 hyper-connection
streams, a window of 16. Prompts of 40, 300 and 1,500 tokens.

The engine keeps a window of each layer's per-token rows and its compressed entries as KV
cache groups (common/engine/kv_groups.py cache_groups); greedy output must equal HF
``generate``'s with chunks, preemption and prefix-cache hits (bounded replay), and the
blocks a sequence holds follow the formula.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from pdserve.common.engine.config import EngineConfig
from pdserve.common.engine.kv_groups import cache_groups
from pdserve.common.engine.latent_format import cache_head
from pdserve.common.engine.llm_engine import LLMEngine
from pdserve.common.engine.sampling import SamplingParams
from pdserve.common.errors import ModelLoadError
from pdserve.common.model.checkpoint.config import ModelConfig
from pdserve.common.model.fixtures.random import RANDOM_V4, save_random_v4
from tests.test_families import (
    NUM_TOKENS,
    engine_greedy,
    hf_greedy,
    preemption_gives_the_reference,
    sentence_prompts,
)

transformers = pytest.importorskip("transformers")

PROMPT_LENGTHS = (40, 300, 1500)
V4: dict[str, Any] = RANDOM_V4


@pytest.fixture(scope="module")
def v4_model(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> Path:
    return save_random_v4(tmp_path_factory.mktemp("dsv4") / "v4", tokenizer_from=model_dir)


@pytest.fixture(scope="module")
def prompts(model_dir: Path) -> list[list[int]]:
    return sentence_prompts(model_dir, PROMPT_LENGTHS, 200)


@pytest.fixture(scope="module")
def reference(v4_model: Path, prompts: list[list[int]]) -> list[list[int]]:
    return hf_greedy(v4_model, prompts)


def test_config_reads_v4_as_transformers_does(v4_model: Path) -> None:
    cfg = ModelConfig.from_dir(v4_model)
    hf = transformers.AutoConfig.from_pretrained(v4_model)
    v4 = cfg.v4
    assert cfg.architecture == "DeepseekV4ForCausalLM" and v4 is not None
    assert list(v4.layer_kinds) == hf.layer_types and list(v4.mlp_kinds) == hf.mlp_layer_types
    assert v4.rope_dim == hf.qk_rope_head_dim == 8
    assert [v4.rate(i) for i in range(4)] == [0, 4, 16, 4]
    assert cfg.sliding_window == 16 and cfg.num_key_value_heads == 1
    # one row a token and layer: K=V (32), CSA's two series of kv and gate (4 x 32), its
    # indexer's (4 x 16)
    assert cache_head(cfg, "float32") == (32 + 128 + 64, 1, "float32")
    # every layer's rows over a window of 16 (CSA's 2 x 4 and HCA's 16 fit in it), then
    # the entries of the CSA layers (1 / 4) and the HCA layer (1 / 16): groups of one layer
    groups = cache_groups(cfg)
    assert [(g.layers, g.sliding_window, g.rate) for g in groups] == [
        ((0,), 16, 1), ((1,), 16, 1), ((2,), 16, 1), ((3,), 16, 1),
        ((1,), None, 4), ((3,), None, 4), ((2,), None, 16),
    ]  # fmt: skip


def test_what_is_not_implemented_is_refused_by_name(v4_model: Path) -> None:
    from pdserve.common.engine.model_loader import check_device_supports
    from pdserve.common.model.families.deepseek_v4 import build_model
    from pdserve.common.parallel.context import ParallelContext

    cfg = ModelConfig.from_dir(v4_model)
    check_device_supports(cfg, torch.device("cuda"))  # kernels/v4_ops.py: no refusal on CUDA
    # fp8 (tests/test_fp8_dsv4.py) tiles the nope values by 64: this model has 32 - 8
    with pytest.raises(ModelLoadError, match="--kv-cache-dtype: .*multiple of 64.* = 24"):
        LLMEngine(EngineConfig(model=str(v4_model), num_kv_blocks=8, kv_cache_dtype="fp8"))
    # 4 heads split over TP 4, its 2 output groups do not
    with pytest.raises(ModelLoadError, match="o_groups 2 .* do not split over TP 4"):
        build_model(cfg, ParallelContext(tp_size=4))
    raw = transformers.DeepseekV4Config(**V4).to_dict()
    with pytest.raises(ModelLoadError, match="scoring_func 'softmax'"):
        ModelConfig.from_dict({**raw, "scoring_func": "softmax"})


def test_greedy_tokens_identical_to_transformers(
    v4_model: Path, prompts: list[list[int]], reference: list[list[int]]
) -> None:
    assert engine_greedy(v4_model, prompts) == reference
    short = [prompts[0][:6]]  # fewer tokens than one HCA entry: no entries at all
    assert engine_greedy(v4_model, short) == hf_greedy(v4_model, short)


def test_the_indexer_and_the_window_decide_the_output(
    tmp_path: Path, model_dir: Path, prompts: list[list[int]], reference: list[list[int]]
) -> None:
    """The same weights with the indexer keeping every entry, or a window over the whole
    prompt: HF gives other tokens, so the identity above checks both."""
    every_entry = save_random_v4(tmp_path / "topk", tokenizer_from=model_dir, index_topk=4096)
    assert hf_greedy(every_entry, prompts[1:2]) != reference[1:2]
    whole = save_random_v4(tmp_path / "window", tokenizer_from=model_dir, sliding_window=4096)
    assert hf_greedy(whole, prompts[1:2]) != reference[1:2]


def test_chunks_not_aligned_to_entries_or_blocks(
    v4_model: Path, prompts: list[list[int]], reference: list[list[int]]
) -> None:
    """Blocks of 16 and 98-token chunks (a multiple of neither 4 nor 16): windows and
    compression strides straddle chunks; decodes and chunks share steps."""
    got = engine_greedy(v4_model, prompts[:2] * 2, block_size=16, max_num_batched_tokens=98)
    assert got == reference[:2] * 2


def test_preemption_and_resume(
    v4_model: Path, prompts: list[list[int]], reference: list[list[int]]
) -> None:
    # blocks of one layer: 7 groups (see the config test)
    preemption_gives_the_reference(v4_model, prompts, reference, num_kv_blocks=40)


def test_prefix_cache_hit_replays_at_most_a_window_and_a_stride(
    v4_model: Path, prompts: list[list[int]], reference: list[list[int]]
) -> None:
    prefix_hit_replays_a_window_and_a_stride(v4_model, prompts, reference)


def prefix_hit_replays_a_window_and_a_stride(
    v4_model: Path, prompts: list[list[int]], reference: list[list[int]], **engine_fields: Any
) -> None:
    """The 1,500-token prompt after a request sharing its first 1,000 tokens: the hit takes
    the window's blocks and the entries' (the open CSA and HCA blocks copied on write),
    computes only the tail; then with a block inside the window of the hit lost, the hit
    is cut back and at most the window plus a stride (16 + 16) is replayed, as the counter
    says. Blocks of 8, so that the window spans two of them. ``engine_fields``: more
    EngineConfig fields (tests/test_dsv4_gpu.py: CUDA)."""
    from pdserve.common.engine.block_pool import hash_blocks
    from pdserve.common.runtime.engine_thread import report_engine
    from pdserve.common.runtime.metrics import Metrics

    engine = LLMEngine(
        EngineConfig(
            model=str(v4_model),
            block_size=8,
            num_kv_blocks=1024,
            max_num_batched_tokens=256,
            **engine_fields,
        )
    )
    sampling = SamplingParams(max_tokens=NUM_TOKENS)
    engine.generate([prompts[2][:1000]], sampling)
    before = engine.scheduler.num_computed_tokens
    [hit] = engine.generate([prompts[2]], sampling)
    assert hit.token_ids == reference[2]
    assert engine.scheduler.num_computed_tokens - before == 1500 - 1000 + NUM_TOKENS - 1
    assert engine.scheduler.num_replayed_tokens == 0
    # the second request's blocks now hit at 1,496 (187 blocks); the rows' window of 1,496
    # is blocks 185 and 186: lose layer 0's 185
    hashes = hash_blocks(prompts[2], 8)
    assert engine.pool.evict(hashes[185])
    before = engine.scheduler.num_computed_tokens
    [again] = engine.generate([prompts[2]], sampling)
    assert again.token_ids == reference[2]
    metrics = Metrics("decode", 0)
    report_engine(metrics, engine, 0, 0)
    replayed = metrics.value("pdserve:prefix_cache_replayed_tokens")
    window, stride = 16, 16
    assert 0 < replayed <= window + stride
    # the tail from where the hit was cut back to (1,480: its CSA and HCA blocks open)
    assert replayed == 16
    computed = engine.scheduler.num_computed_tokens - before
    assert computed == 1500 - 1496 + replayed + NUM_TOKENS - 1
    assert engine.pool.num_free_blocks == engine.pool.num_blocks


def test_blocks_a_sequence_holds_follow_the_formula() -> None:
    """The engine's own accounting (the pure scheduler, no model run) of one sequence of
    1k and 8k tokens on the test model's groups, blocks of 16: every layer's rows bounded
    by the window (W' = 16: ceil(16 / 16) + 1 blocks at most), CSA entries tokens / 4 (one
    block a 64 tokens), HCA entries tokens / 16 here (one block a 256 tokens); before
    groups, every layer kept every token (4 x tokens / 16 blocks of one layer)."""
    from pdserve.common.engine.block_pool import BlockPool
    from pdserve.common.engine.request import Request
    from pdserve.common.engine.scheduler import Scheduler

    raw = transformers.DeepseekV4Config(**V4).to_dict()
    groups = cache_groups(ModelConfig.from_dict(raw))
    for num in (1024, 8192):
        pool = BlockPool(4096)
        sched = Scheduler(pool, 16, 4, 512, groups=groups)
        req = Request("a", list(range(num)), SamplingParams(max_tokens=1))
        sched.add(req)
        while req.num_computed_tokens < num:
            plan, reqs = sched.schedule()
            sched.on_step_done(reqs, plan)
        held = [len(req.held_of_group(g)) for g in range(len(groups))]
        assert held[:4] == [1] * 4  # the window's rows: behind it, blocks went back
        assert held[4:6] == [-(-num // 64)] * 2  # CSA: tokens / 4 entries, 16 a block
        assert held[6] == -(-num // 256)  # HCA (rate 16 here): tokens / 16 entries
        # the bound admission counts with (decoding: a window of W' plus one block)
        bound = sched.tables.max_blocks(num, chunk=1)
        assert bound == 4 * 2 + 2 * -(-num // 64) + -(-num // 256)
        assert sum(held) <= bound < 4 * num // 16
    # V4-Flash's kinds: a window of 128 (HCA's 128 and CSA's 2 x 4 fit), entries 1/4, 1/128
    flash = ModelConfig.from_dict({**raw, "sliding_window": 128, "compress_rates": None})
    kinds = [(g.sliding_window, g.rate) for g in cache_groups(flash)]
    assert kinds[:4] == [(128, 1)] * 4 and sorted(kinds[4:]) == [(None, 4)] * 2 + [(None, 128)]


TEXTS = [
    "Monday, Tuesday,",
    "The quick brown fox jumps over the lazy dog. " * 30,  # ~300 tokens: several blocks
]


@pytest.mark.slow
@pytest.mark.parametrize("flags", [{}, {"pcp": 2}], ids=["tp1", "pcp2"])
def test_disaggregated_through_the_openai_api(
    tmp_path: Path, v4_model: Path, model_dir: Path, flags: dict[str, int]
) -> None:
    """`pdserve up`: prefill (TP 1, or PCP 2: each rank gathers every new token's row, so
    zigzag pieces rebuild entries and windows that straddle them) to decode TP 1 over NIXL;
    the pulled blocks carry every row a decode step rebuilds windows and entries from.
    HF's text, pools full after."""
    from pdserve.common.model.checkpoint.tokenizer import Tokenizer
    from tests.e2e import deployment
    from tests.test_serving import assert_pools_full, post

    tok = Tokenizer.from_dir(model_dir)
    want = [tok.decode(t) for t in hf_greedy(v4_model, [tok.encode(x) for x in TEXTS])]
    with deployment(tmp_path, v4_model, engine={"kv_cache_memory_gb": 0.05}, **flags) as dep:
        for text, expected in zip(TEXTS, want, strict=True):
            body = {"prompt": text, "max_tokens": NUM_TOKENS, "temperature": 0}
            status, answer = post(dep.url, "/v1/completions", body)
            assert status == 200, answer
            assert answer["choices"][0]["text"] == expected
        assert_pools_full(dep.url)


@pytest.mark.slow
def test_tp2_rank_group_matches_transformers(
    v4_model: Path, prompts: list[list[int]], reference: list[list[int]]
) -> None:
    """Two TP rank processes prefill and decode: heads, output groups and experts split
    (common/model/deepseek/dsv4_tp.py), HF's tokens."""
    from pdserve.services.ranks.group import RankGroup

    cfg = EngineConfig(model=str(v4_model), kv_cache_memory_gb=0.02)
    ranks = RankGroup.decode(cfg, 2, "test-dsv4-tp2")
    try:
        engine = LLMEngine(cfg, runner=ranks)
        got = engine.generate(prompts[:2], SamplingParams(max_tokens=NUM_TOKENS))
        assert [o.token_ids for o in got] == reference[:2]
    finally:
        ranks.close()


@pytest.mark.slow
def test_pcp4_prefill_to_decode_tp_1_and_2(
    tmp_path: Path, v4_model: Path, prompts: list[list[int]], reference: list[list[int]]
) -> None:
    """Prefill PCP 4 to decode TP 1 and TP 2 (tests/pd_families.py): prompts of 40, 300
    and 1,500 tokens, HF's tokens."""
    from tests.pd_families import pcp4_to_decode_tp_1_and_2

    pcp4_to_decode_tp_1_and_2(tmp_path, v4_model, prompts, reference)
