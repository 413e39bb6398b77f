"""Mistral (``MistralForCausalLM``): Llama's model with no bias anywhere and, when
``sliding_window`` is set, that window on every layer (``MistralAttention`` passes it to
each layer)."""

from __future__ import annotations

from typing import Any

from pdserve.common.model.checkpoint.config import SLIDING_ATTENTION, ModelConfig
from pdserve.common.model.families.llama import build_model as build_model
from pdserve.common.model.families.llama import read_llama_shaped


def read_config(raw: dict[str, Any]) -> ModelConfig:
    window = raw.get("sliding_window")
    kinds = (window, (SLIDING_ATTENTION,) * raw["num_hidden_layers"]) if window else None
    return read_llama_shaped(raw, layer_kinds=kinds)
