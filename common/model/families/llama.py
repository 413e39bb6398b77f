"""Llama (``LlamaForCausalLM``): the dense decoder every Llama-shaped family varies.

Llama's switches, as transformers' Llama reads them: ``attention_bias`` on q/k/v and o_proj,
``mlp_bias`` on the MLP, no sliding window (``LlamaAttention`` ignores ``sliding_window``).

:func:`read_llama_shaped` reads what the Llama-shaped config.json files share (sizes,
heads, rope, token ids) with the switches a family passes; :func:`build_model` builds them
all: grouped-query attention (common/model/layers/gqa.py) and the gated MLP (common/model/layers/mlp.py).
Mistral, Qwen2 and Qwen3 are this model with other switches: their modules import
``build_model`` from here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pdserve.common.model.checkpoint.config import (
    FULL_ATTENTION,
    ModelConfig,
    eos_token_ids,
    rope_parameters,
)
from pdserve.common.model.checkpoint.moe_config import MoEConfig

if TYPE_CHECKING:
    from pdserve.common.model.decoder import CausalLM
    from pdserve.common.parallel.context import ParallelContext

# (window, per-layer kinds) of a config with no sliding layer
LayerKinds = tuple[int | None, tuple[str, ...]]


def full_attention(num_layers: int) -> LayerKinds:
    return None, (FULL_ATTENTION,) * num_layers


def read_config(raw: dict[str, Any]) -> ModelConfig:
    bias = raw.get("attention_bias", False)
    return read_llama_shaped(
        raw, attention_bias=bias, o_proj_bias=bias, mlp_bias=raw.get("mlp_bias", False)
    )


def read_llama_shaped(
    raw: dict[str, Any],
    *,
    attention_bias: bool = False,  # on q/k/v
    o_proj_bias: bool = False,
    qk_norm: bool = False,
    mlp_bias: bool = False,
    layer_kinds: LayerKinds | None = None,  # None: full attention on every layer
    moe: MoEConfig | None = None,
) -> ModelConfig:
    num_heads = raw["num_attention_heads"]
    num_layers = raw["num_hidden_layers"]
    rope = rope_parameters(raw)
    window, layer_types = layer_kinds or full_attention(num_layers)
    return ModelConfig(
        model_type=raw["model_type"],
        vocab_size=raw["vocab_size"],
        hidden_size=raw["hidden_size"],
        intermediate_size=raw["intermediate_size"],
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=raw.get("num_key_value_heads") or num_heads,
        head_dim=raw.get("head_dim") or raw["hidden_size"] // num_heads,
        max_position_embeddings=raw.get("max_position_embeddings", 2048),
        rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
        rope_theta=rope.pop("rope_theta", 10000.0),
        rope_scaling=rope or None,
        tie_word_embeddings=raw.get("tie_word_embeddings", False),
        sliding_window=window,
        layer_types=layer_types,
        attention_bias=attention_bias,
        o_proj_bias=o_proj_bias,
        qk_norm=qk_norm,
        mlp_bias=mlp_bias,
        bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=eos_token_ids(raw),
        moe=moe,
    )


def build_model(cfg: ModelConfig, parallel: ParallelContext | None) -> CausalLM:
    # torch only here: reading a config (the router does) imports none
    from pdserve.common.model.decoder import CausalLM
    from pdserve.common.model.layers.gqa import GQAAttention
    from pdserve.common.model.layers.mlp import MLP

    return CausalLM(cfg, parallel, GQAAttention, MLP)
