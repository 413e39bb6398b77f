"""Qwen3-MoE (``Qwen3MoeForCausalLM``): Qwen3's attention, and on the sparse layers a
mixture of experts routed by softmax (common/model/checkpoint/moe_config.py: ``qwen3_moe_experts``;
common/model/layers/moe.py); the other layers (``mlp_only_layers``, ``decoder_sparse_step``) keep
the dense MLP. ``Qwen3MoeConfig`` keeps a window only with ``use_sliding_window``, then on
every layer."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pdserve.common.model.checkpoint.config import SLIDING_ATTENTION, ModelConfig
from pdserve.common.model.checkpoint.moe_config import qwen3_moe_experts
from pdserve.common.model.families.llama import read_llama_shaped

if TYPE_CHECKING:
    from pdserve.common.model.decoder import CausalLM
    from pdserve.common.parallel.context import ParallelContext


def read_config(raw: dict[str, Any]) -> ModelConfig:
    num_layers = raw["num_hidden_layers"]
    window = raw.get("sliding_window")
    every = window and raw.get("use_sliding_window", False)
    bias = raw.get("attention_bias", False)
    return read_llama_shaped(
        raw,
        attention_bias=bias,
        o_proj_bias=bias,
        qk_norm=True,
        layer_kinds=(window, (SLIDING_ATTENTION,) * num_layers) if every else None,
        moe=qwen3_moe_experts(raw, num_layers),
    )


def build_model(cfg: ModelConfig, parallel: ParallelContext | None) -> CausalLM:
    # torch only here: reading a config (the router does) imports none
    from pdserve.common.model.decoder import CausalLM
    from pdserve.common.model.layers.gqa import GQAAttention
    from pdserve.common.model.layers.mlp import sparse_or_dense_mlp

    return CausalLM(cfg, parallel, GQAAttention, sparse_or_dense_mlp)
