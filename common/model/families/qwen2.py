"""Qwen2 (``Qwen2ForCausalLM``): Llama's model with a bias on q/k/v always (none on o_proj
or the MLP) and, with ``use_sliding_window``, a window on some layers only.

Which layers slide, as ``Qwen2Config.__post_init__`` decides (Qwen3 reads it the same way):
no window unless ``use_sliding_window``; the kinds from ``layer_types`` when given, else
sliding from ``max_window_layers`` on. (Qwen2.5 ships ``sliding_window`` with
``use_sliding_window`` false: no window anywhere.)
"""

from __future__ import annotations

from typing import Any

from pdserve.common.errors import ModelLoadError
from pdserve.common.model.checkpoint.config import FULL_ATTENTION, SLIDING_ATTENTION, ModelConfig
from pdserve.common.model.families.llama import LayerKinds, read_llama_shaped
from pdserve.common.model.families.llama import build_model as build_model


def read_config(raw: dict[str, Any]) -> ModelConfig:
    return read_llama_shaped(raw, attention_bias=True, layer_kinds=qwen2_layer_kinds(raw))


def qwen2_layer_kinds(raw: dict[str, Any]) -> LayerKinds | None:
    """(window, layer_types) of a Qwen2/Qwen3 config; None: full attention everywhere."""
    window = raw.get("sliding_window")
    if not window or not raw.get("use_sliding_window", False):
        return None
    num_layers = raw["num_hidden_layers"]
    given = raw.get("layer_types")
    if given is None:
        first = raw.get("max_window_layers", 28)
        given = [SLIDING_ATTENTION if i >= first else FULL_ATTENTION for i in range(num_layers)]
    if len(given) != num_layers or set(given) - {FULL_ATTENTION, SLIDING_ATTENTION}:
        raise ModelLoadError(
            f"layer_types {given!r} must name {FULL_ATTENTION!r} or {SLIDING_ATTENTION!r} "
            f"for each of the {num_layers} layers"
        )
    if SLIDING_ATTENTION not in given:
        return None
    return window, tuple(given)
