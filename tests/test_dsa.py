"""DeepSeek-V3.2 (sparse attention: MLA over the tokens a lightning indexer selects)
against Hugging Face transformers, token for token.

The checkpoint is built by transformers' own ``DeepseekV32Config`` and
``DeepseekV32ForCausalLM`` (random weights, float32, the embedded model's tokenizer): a
dense layer then a MoE one, ``index_topk`` 24, far below the prompts (40, 300, 1,500
tokens), so the selection decides the output (the same weights with every token selected
give other tokens: checked). 16 indexer heads: with few heads a key's score is often exactly
0 (every head's ReLU zero) and ties would decide the selection.

Our engine caches one row per token and layer, latent ++ rope key ++ indexer key
(common/engine/latent_format.py), and attends through kernels.indexer_topk and
kernels.sparse_mla_attention (common/model/deepseek/dsa.py; their torch references on CPU;
tests/test_dsv32_gpu.py runs the Triton kernels on CUDA). Greedy output
must equal HF ``generate``'s monolithic, in chunks that straddle blocks, under preemption,
from a prefix-cache hit, and (slow) disaggregated at TP 1 and with a PCP 2 prefill.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch

from pdserve.common.engine.config import EngineConfig
from pdserve.common.engine.latent_format import LatentFormat, cache_head
from pdserve.common.engine.llm_engine import LLMEngine
from pdserve.common.engine.sampling import SamplingParams
from pdserve.common.errors import ModelLoadError
from pdserve.common.model.checkpoint.config import ModelConfig
from tests.test_families import (
    NUM_TOKENS,
    engine_greedy,
    hf_greedy,
    preemption_gives_the_reference,
    sentence_prompts,
)

transformers = pytest.importorskip("transformers")

PROMPT_LENGTHS = (40, 300, 1500)
V32: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "q_lora_rank": 32,
    "kv_lora_rank": 32,
    "qk_rope_head_dim": 16,
    "qk_nope_head_dim": 16,
    "v_head_dim": 16,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "n_group": 2,
    "topk_group": 1,
    "n_shared_experts": 1,
    "first_k_dense_replace": 1,
    "num_hidden_layers": 2,
    "index_topk": 24,
    "index_n_heads": 16,
    "index_head_dim": 32,
}


def build_v32(root: Path, tokenizer_from: Path | None = None, **overrides: Any) -> Path:
    from pdserve.common.model.fixtures.random import save_random_model

    return save_random_model(
        root,
        "deepseek_v32",
        max_position_embeddings=4096,
        seed=1,
        tokenizer_from=tokenizer_from,
        **{**V32, **overrides},
    )


@pytest.fixture(scope="module")
def v32_model(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> Path:
    return build_v32(tmp_path_factory.mktemp("dsv32") / "v32", tokenizer_from=model_dir)


@pytest.fixture(scope="module")
def prompts(model_dir: Path) -> list[list[int]]:
    return sentence_prompts(model_dir, PROMPT_LENGTHS, 200)


@pytest.fixture(scope="module")
def reference(v32_model: Path, prompts: list[list[int]]) -> list[list[int]]:
    return hf_greedy(v32_model, prompts)


def test_config_reads_the_indexer_as_transformers_does(v32_model: Path) -> None:
    cfg = ModelConfig.from_dir(v32_model)
    hf = transformers.AutoConfig.from_pretrained(v32_model)
    assert cfg.architecture == "DeepseekV32ForCausalLM" and cfg.is_mla and cfg.is_indexed
    assert (cfg.index_topk, cfg.index_n_heads, cfg.index_head_dim) == (24, 16, 32)
    assert cfg.rope_interleave and cfg.q_lora_rank == hf.q_lora_rank
    assert cfg.moe is not None and cfg.moe.sparse_layers == (1,)  # hf.mlp_layer_types
    assert hf.mlp_layer_types == ["dense", "sparse"]
    attn = transformers.AutoModelForCausalLM.from_config(hf).model.layers[0].self_attn
    assert cfg.softmax_scale == pytest.approx(attn.scaling, rel=1e-12)
    # one cache row: latent, rope key, indexer key
    assert cache_head(cfg, "float32") == (32 + 16 + 32, 1, "float32")
    fmt = LatentFormat(kv_lora_rank=512, rope_dim=64, dtype="bfloat16", index_dim=128)
    assert [(s.name, s.offset) for s in fmt.sections] == [
        ("latent", 0),
        ("rope", 1024),
        ("index", 1152),
    ]
    assert fmt.token_bytes == 1408


def test_what_is_not_implemented_is_refused_by_name(v32_model: Path) -> None:
    from pdserve.common.engine.model_loader import check_device_supports

    cfg = ModelConfig.from_dir(v32_model)
    check_device_supports(cfg, torch.device("cuda"))  # the Triton kernels run it
    odd = msgspec.structs.replace(cfg, index_head_dim=24)
    with pytest.raises(ModelLoadError, match="index_head_dim to be a power of two.* 24"):
        check_device_supports(odd, torch.device("cuda"))
    # fp8 (tests/test_fp8_dsa.py) tiles the latent and the key by 128; this model's are 32
    with pytest.raises(ValueError, match="index_head_dim to be a multiple of 128.* is 32"):
        cache_head(cfg, "bfloat16", "float8_e4m3fn")
    with pytest.raises(ModelLoadError, match="--kv-cache-dtype: .*multiple of 128"):
        LLMEngine(EngineConfig(model=str(v32_model), num_kv_blocks=8, kv_cache_dtype="fp8"))
    raw = transformers.DeepseekV32Config(**V32).to_dict()
    with pytest.raises(ModelLoadError, match="q_lora_rank is null"):
        ModelConfig.from_dict({**raw, "q_lora_rank": None})
    with pytest.raises(ModelLoadError, match="dense layers after sparse"):
        ModelConfig.from_dict({**raw, "mlp_layer_types": ["sparse", "dense"]})


def test_greedy_tokens_identical_to_transformers(
    v32_model: Path, prompts: list[list[int]], reference: list[list[int]]
) -> None:
    assert engine_greedy(v32_model, prompts) == reference


def test_the_selection_decides_the_output(
    tmp_path: Path, model_dir: Path, prompts: list[list[int]], reference: list[list[int]]
) -> None:
    """The same weights with every token selected (index_topk above the prompt): HF gives
    other tokens, so the identity above checks the selection."""
    dense = build_v32(tmp_path / "dense", tokenizer_from=model_dir, index_topk=4096)
    assert hf_greedy(dense, prompts[:2]) != reference[:2]


def test_chunks_across_small_blocks_and_mixed_steps(
    v32_model: Path, prompts: list[list[int]], reference: list[list[int]]
) -> None:
    """Blocks of 16, 100-token chunks (not a multiple of 16): a chunk's indexer scores keys
    that earlier chunks cached; decodes and prefill chunks share steps."""
    got = engine_greedy(v32_model, prompts[:2] * 2, block_size=16, max_num_batched_tokens=100)
    assert got == reference[:2] * 2


def test_preemption_and_resume(
    v32_model: Path, prompts: list[list[int]], reference: list[list[int]]
) -> None:
    """28 blocks of 16 tokens for three sequences of up to 316 (no prefix cache to share
    blocks): the pool runs dry, some are preempted, their rows recomputed on resume."""
    preemption_gives_the_reference(v32_model, prompts, reference, num_kv_blocks=28)


def test_prefix_cache_hit_restores_the_indexer_keys(
    v32_model: Path, prompts: list[list[int]], reference: list[list[int]]
) -> None:
    prefix_hit_restores_the_indexer_keys(v32_model, prompts, reference)


def prefix_hit_restores_the_indexer_keys(
    v32_model: Path, prompts: list[list[int]], reference: list[list[int]], **engine_fields: Any
) -> None:
    """The 300-token prompt again: its cached blocks (latent and indexer keys) serve the
    second request, which computes only the tail, and answers the same. ``engine_fields``:
    more EngineConfig fields (tests/test_dsv32_gpu.py: CUDA)."""
    engine = LLMEngine(
        EngineConfig(model=str(v32_model), block_size=16, num_kv_blocks=64, **engine_fields)
    )
    sampling = SamplingParams(max_tokens=NUM_TOKENS)
    assert engine.generate([prompts[1]], sampling)[0].token_ids == reference[1]
    before = engine.scheduler.num_computed_tokens
    assert engine.generate([prompts[1]], sampling)[0].token_ids == reference[1]
    computed = engine.scheduler.num_computed_tokens - before
    assert computed < len(prompts[1]) // 2, computed


TEXTS = [
    "Monday, Tuesday,",
    "The quick brown fox jumps over the lazy dog. " * 30,  # ~300 tokens: several blocks
]


@pytest.mark.slow
@pytest.mark.parametrize("flags", [{}, {"pcp": 2}], ids=["tp1", "pcp2"])
def test_disaggregated_through_the_openai_api(
    tmp_path: Path, v32_model: Path, model_dir: Path, flags: dict[str, int]
) -> None:
    """`pdserve up`: prefill (TP 1, or PCP 2: each rank's zigzag pieces select among every
    rank's indexer keys) to decode TP 1 over NIXL: HF's tokens, every pool full after, and
    the bytes pulled are the whole rows (latent, rope and indexer key) of every block."""
    from pdserve.common.model.checkpoint.tokenizer import Tokenizer
    from tests.e2e import deployment
    from tests.test_serving import assert_pools_full, metrics, post, total

    tok = Tokenizer.from_dir(model_dir)
    ids = [tok.encode(x) for x in TEXTS]
    want = [tok.decode(t) for t in hf_greedy(v32_model, ids)]
    with deployment(tmp_path, v32_model, engine={"kv_cache_memory_gb": 0.05}, **flags) as dep:
        for text, expected in zip(TEXTS, want, strict=True):
            body = {"prompt": text, "max_tokens": NUM_TOKENS, "temperature": 0}
            status, answer = post(dep.url, "/v1/completions", body)
            assert status == 200, answer
            assert answer["choices"][0]["text"] == expected
        assert_pools_full(dep.url)
        cfg, block = ModelConfig.from_dir(v32_model), dep.cfg.engine.block_size
        block_bytes = cfg.num_hidden_layers * block * cache_head(cfg, "float32")[0] * 4
        blocks = sum(-(-len(i) // block) for i in ids)
        pulled = total(metrics(dep.url), "pdserve:kv_transfer_bytes_total", "decode")
        assert pulled == blocks * block_bytes


@pytest.mark.slow
def test_pcp4_prefill_to_decode_tp_1_and_2(
    tmp_path: Path, v32_model: Path, prompts: list[list[int]], reference: list[list[int]]
) -> None:
    """Prefill PCP 4 to decode TP 1 and TP 2 (tests/pd_families.py): the 40- and 300-token
    prompts, HF's tokens (the TP 2 ranks split the MLA heads, the indexer replicated)."""
    from tests.pd_families import pcp4_to_decode_tp_1_and_2

    pcp4_to_decode_tp_1_and_2(tmp_path, v32_model, prompts[:2], reference[:2])


def test_step_queries_once_a_step() -> None:
    """Each query's sequence and visible keys (a decode, then a prefill run of 3 tokens at
    positions 5..7): built once a step for every layer, anew for the next step's (or a
    CUDA graph capture's) rope tensor."""
    from pdserve.common.model.deepseek.dsa import StepQueries
    from pdserve.common.model.layers.attention import AttentionMetadata

    meta = AttentionMetadata(
        slot_mapping=torch.arange(4),
        num_decode_tokens=1,
        decode_context_lens=torch.tensor([9], dtype=torch.int32),
        decode_block_tables=torch.tensor([[3]], dtype=torch.int32),
        prefill_cu_seqlens_q=torch.tensor([0, 3], dtype=torch.int32),
        prefill_context_lens=torch.tensor([8], dtype=torch.int32),
        prefill_block_tables=torch.tensor([[1, 2]], dtype=torch.int32),
    )
    step = StepQueries.of(meta, 4)
    assert step.query_seq.tolist() == [0, 1, 1, 1]
    assert step.num_visible.tolist() == [9, 6, 7, 8]
    assert step.block_tables.tolist() == [[3, 0], [1, 2]]
    token = torch.zeros(1)
    first = StepQueries.once_a_step(meta, token, 4)
    assert StepQueries.once_a_step(meta, token, 4) is first  # the step's next layer
    assert StepQueries.once_a_step(meta, torch.zeros(1), 4) is not first  # the next step
