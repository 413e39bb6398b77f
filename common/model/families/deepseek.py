"""DeepSeek V2 and V3 (``DeepseekV2ForCausalLM``, ``DeepseekV3ForCausalLM``): multi-head
latent attention on every layer (common/model/layers/mla.py) and, V3 only, a mixture of experts from
``first_k_dense_replace`` on (common/model/checkpoint/moe_config.py: ``deepseek_v3_experts``; grouped
sigmoid routing and shared experts, common/model/layers/moe.py).

As transformers' ``DeepseekV2Config``/``DeepseekV3Config`` read config.json: the KV cache is
one latent per token, so ``num_key_value_heads`` is 1 (every query head attends the one
latent, replicated on every TP rank) and ``head_dim`` is the rope part ``qk_rope_head_dim``
(as transformers sets it); a cache slot is the latent (``row_kind``). Rope
rotates interleaved pairs (V2 always, V3 with ``rope_interleave``). V2's experts are not
routed: a V2 config with a sparse layer is refused. The checkpoint's multi-token-prediction
layers (``num_nextn_predict_layers``) are not part of the model (common/model/draft/mtp.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pdserve.common.errors import ModelLoadError
from pdserve.common.model.checkpoint.config import (
    FULL_ATTENTION,
    ModelConfig,
    eos_token_ids,
    rope_parameters,
)
from pdserve.common.model.checkpoint.moe_config import deepseek_v3_experts
from pdserve.common.model.family_api import mla_unsupported

if TYPE_CHECKING:
    from pdserve.common.model.decoder import CausalLM
    from pdserve.common.parallel.context import ParallelContext


def read_config(raw: dict[str, Any]) -> ModelConfig:
    model_type = raw["model_type"]
    is_v3 = model_type == "deepseek_v3"
    num_layers = raw["num_hidden_layers"]
    # transformers' defaults when the key is absent (V2: 0, V3: 3)
    dense = raw.get("first_k_dense_replace", 3 if is_v3 else 0)
    if not is_v3 and (dense is None or dense < num_layers):
        raise ModelLoadError(
            f"{model_type}: layers {dense}..{num_layers - 1} are mixture-of-experts "
            f"(first_k_dense_replace={dense} < num_hidden_layers={num_layers}); pdserve "
            "routes DeepSeek-V3's experts (common/model/checkpoint/moe_config.py), not V2's"
        )
    rope_dim = raw.get("qk_rope_head_dim", 64)
    rope = rope_parameters(raw)
    bias = raw.get("attention_bias", False)
    return ModelConfig(
        model_type=model_type,
        vocab_size=raw["vocab_size"],
        hidden_size=raw["hidden_size"],
        intermediate_size=raw["intermediate_size"],
        num_hidden_layers=num_layers,
        num_attention_heads=raw["num_attention_heads"],
        num_key_value_heads=1,  # one latent, shared by every query head
        head_dim=rope_dim,  # the rotary part, as transformers' config sets head_dim
        max_position_embeddings=raw.get("max_position_embeddings", 2048),
        rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
        rope_theta=rope.pop("rope_theta", 10000.0),
        rope_scaling=rope or None,
        tie_word_embeddings=raw.get("tie_word_embeddings", False),
        layer_types=(FULL_ATTENTION,) * num_layers,
        attention_bias=bias,  # on q_a_proj and kv_a_proj_with_mqa
        o_proj_bias=bias,
        mlp_bias=not is_v3 and raw.get("mlp_bias", False),
        bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=eos_token_ids(raw),
        kv_lora_rank=raw.get("kv_lora_rank", 512),
        q_lora_rank=raw.get("q_lora_rank", 1536),
        qk_nope_head_dim=raw.get("qk_nope_head_dim", 128),
        qk_rope_head_dim=rope_dim,
        v_head_dim=raw.get("v_head_dim", 128),
        rope_interleave=not is_v3 or raw.get("rope_interleave", True),
        moe=deepseek_v3_experts(raw, num_layers) if is_v3 else None,
        # transformers' V3 default is 1 (its alias num_mtp_layers); V2 has none
        num_nextn_predict_layers=raw.get(
            "num_nextn_predict_layers", raw.get("num_mtp_layers", 1 if is_v3 else 0)
        )
        or 0,
    )


def build_model(cfg: ModelConfig, parallel: ParallelContext | None) -> CausalLM:
    # torch only here: reading a config (the router does) imports none
    from pdserve.common.model.decoder import CausalLM
    from pdserve.common.model.layers.mla import MLAAttention
    from pdserve.common.model.layers.mlp import sparse_or_dense_mlp

    return CausalLM(cfg, parallel, MLAAttention, sparse_or_dense_mlp)


def unsupported_ops(cfg: ModelConfig, device_type: str) -> dict[str, str]:
    return mla_unsupported(cfg, device_type)
