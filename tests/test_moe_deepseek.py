"""DeepSeek-V3 mixture of experts against Hugging Face transformers.

The sparse block (sigmoid scores + ``e_score_correction_bias``, top-k inside the
``topk_group`` best of ``n_group`` groups, ``routed_scaling_factor``, ``norm_topk_prob``,
shared experts) against transformers' own ``DeepseekV3MoE`` with the same random weights;
the config hook (dense first ``first_k_dense_replace`` layers); and the whole
``DeepseekV3ForCausalLM``, which skips until ModelConfig reads ``deepseek_v3`` (its MLA
attention is another branch's) and then must give HF's tokens at TP 1 and 2. Expert
parallelism of this block over gloo ranks: tests/test_moe.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from pdserve.common.engine.config import EngineConfig
from pdserve.common.engine.llm_engine import LLMEngine
from pdserve.common.engine.sampling import SamplingParams
from pdserve.common.errors import ModelLoadError
from pdserve.common.model.checkpoint.config import ModelConfig
from pdserve.common.model.checkpoint.moe_config import MoEConfig, deepseek_v3_experts
from pdserve.common.model.layers.moe import SparseMoeBlock
from pdserve.common.parallel.context import ParallelContext
from tests.test_families import engine_greedy, hf_greedy

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def prompts(model_dir: Path) -> list[list[int]]:
    from pdserve.common.model.checkpoint.tokenizer import Tokenizer

    text = "The quick brown fox jumps over the lazy dog while the cat sleeps. " * 120
    ids = Tokenizer.from_dir(model_dir).encode(text)
    return [ids[:n] for n in (6, 100)]


# -- DeepSeek-V3 routing, against transformers' own block -----------------------------------

DEEPSEEK: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "n_routed_experts": 16,
    "num_experts_per_tok": 4,
    "n_group": 4,
    "topk_group": 2,
    "n_shared_experts": 2,
    "routed_scaling_factor": 2.5,
    "first_k_dense_replace": 1,
    "num_hidden_layers": 3,
}


def deepseek_block(norm_topk_prob: bool, seed: int = 0) -> tuple[Any, MoEConfig]:
    """transformers' DeepseekV3MoE with random weights (correction bias too), our config."""
    hf_cfg = transformers.DeepseekV3Config(**DEEPSEEK, norm_topk_prob=norm_topk_prob)
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

    torch.manual_seed(seed)
    block = DeepseekV3MoE(hf_cfg).eval()
    with torch.no_grad():
        for tensor in [*block.parameters(), *block.buffers()]:
            tensor.normal_(0.0, 0.2)
    moe = deepseek_v3_experts(hf_cfg.to_dict(), DEEPSEEK["num_hidden_layers"])
    assert moe is not None and moe.sparse_layers == (1, 2)
    return block, moe


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_deepseek_v3_block_equals_transformers(norm_topk_prob: bool) -> None:
    hf, moe = deepseek_block(norm_topk_prob)
    ours = SparseMoeBlock(DEEPSEEK["hidden_size"], moe, ParallelContext())
    ours.load_state_dict(hf.state_dict())  # the same names: gate, experts, shared_experts
    x = torch.randn(1, 37, DEEPSEEK["hidden_size"])
    with torch.inference_mode():
        _, hf_weights, hf_ids = hf.gate(x)
        weights, ids = ours.gate(x[0])
        want, got = hf(x)[0], ours(x[0])
    # the same experts with the same weights (HF's top-k is unsorted: compare sorted)
    order, hf_order = ids.sort(dim=-1)[1], hf_ids.sort(dim=-1)[1]
    assert torch.equal(ids.gather(1, order), hf_ids.gather(1, hf_order))
    torch.testing.assert_close(weights.gather(1, order), hf_weights.gather(1, hf_order))
    # the group limit is real here: some token's best raw-score expert lies outside its groups
    scores = torch.sigmoid(x[0] @ hf.gate.weight.t()) + hf.gate.e_score_correction_bias
    assert (scores.argmax(-1, keepdim=True) != ids).all(-1).any()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_deepseek_config_hook_reads_dense_and_sparse_layers() -> None:
    raw = transformers.DeepseekV3Config(**DEEPSEEK).to_dict()
    moe = deepseek_v3_experts(raw, 3)
    assert moe is not None
    assert (moe.num_experts, moe.top_k, moe.num_shared_experts) == (16, 4, 2)
    assert moe.shared_intermediate_size == 64 and moe.sparse_layers == (1, 2)
    with pytest.raises(ModelLoadError, match="topk_group 1 of n_group 4"):
        deepseek_v3_experts({**raw, "topk_group": 1, "num_experts_per_tok": 5}, 3)


# -- DeepSeek-V3, the whole model: runs once MLA attention is in the tree -------------------

DEEPSEEK_MODEL: dict[str, Any] = {
    **DEEPSEEK,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "n_group": 2,
    "topk_group": 1,
    "n_shared_experts": 1,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "q_lora_rank": 32,
    "kv_lora_rank": 16,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 16,
    "v_head_dim": 16,
}


@pytest.mark.parametrize("tp", [1, 2, pytest.param(4, marks=pytest.mark.slow)])
def test_deepseek_v3_greedy_tokens_identical_to_transformers(
    tmp_path: Path, prompts: list[list[int]], tp: int
) -> None:
    """Skipped while ModelConfig refuses deepseek_v3 (MLA attention is another branch's);
    once it reads it, the MoE layers here must give HF's tokens at TP 1 and 2."""
    from pdserve.common.model.fixtures.random import save_random_model

    hf_cfg = transformers.DeepseekV3Config(**DEEPSEEK_MODEL)
    try:
        cfg = ModelConfig.from_dict(hf_cfg.to_dict())
    except ModelLoadError as exc:
        pytest.skip(f"DeepSeek-V3 attention is not in this tree yet: {exc}")
    assert cfg.moe is not None and cfg.moe.sparse_layers == (1,)
    assert cfg.moe.scoring == "sigmoid" and cfg.moe.num_shared_experts == 1
    model = save_random_model(
        tmp_path / "dsv3", "deepseek_v3", max_position_embeddings=4096, seed=1, **DEEPSEEK_MODEL
    )
    want = hf_greedy(model, prompts[:2])
    if tp == 1:
        assert engine_greedy(model, prompts[:2]) == want
        return
    from pdserve.services.ranks.group import RankGroup

    config = EngineConfig(model=str(model), kv_cache_memory_gb=0.02)
    ranks = RankGroup.decode(config, tp, f"test-dsv3-tp{tp}")
    try:
        outs = LLMEngine(config, runner=ranks).generate(
            prompts[:2], SamplingParams(max_tokens=len(want[0]))
        )
        assert [o.token_ids for o in outs] == want
    finally:
        ranks.close()


@pytest.mark.slow
def test_deepseek_v3_disaggregated_prefill_tp2_pcp2_to_decode_tp1_and_tp2(
    tmp_path: Path, model_dir: Path
) -> None:
    """DeepSeek-V3 with MoE layers (MLA latent replicas, experts split over each TP pair)
    through `pdserve up`: prefill TP 2 x PCP 2, decode instances of TP 1 and TP 2, HF's
    tokens from both and every pool full after."""
    from pdserve.common.model.fixtures.random import save_random_model
    from tests.test_moe import check_disaggregated_tp2_pcp2

    model = save_random_model(
        tmp_path / "dsv3", "deepseek_v3", max_position_embeddings=4096, seed=1, **DEEPSEEK_MODEL
    )
    check_disaggregated_tp2_pcp2(tmp_path, model, model_dir)
