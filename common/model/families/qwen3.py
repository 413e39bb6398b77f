"""Qwen3, dense (``Qwen3ForCausalLM``): Llama's model with an RMSNorm over head_dim of each
q and k head before RoPE (``q_norm``/``k_norm``), a head_dim independent of hidden/heads,
``attention_bias`` on q/k/v and o_proj, and Qwen2's sliding layers."""

from __future__ import annotations

from typing import Any

from pdserve.common.model.checkpoint.config import ModelConfig
from pdserve.common.model.families.llama import build_model as build_model
from pdserve.common.model.families.llama import read_llama_shaped
from pdserve.common.model.families.qwen2 import qwen2_layer_kinds


def read_config(raw: dict[str, Any]) -> ModelConfig:
    bias = raw.get("attention_bias", False)
    return read_llama_shaped(
        raw,
        attention_bias=bias,
        o_proj_bias=bias,
        qk_norm=True,
        layer_kinds=qwen2_layer_kinds(raw),
    )
