"""ModelConfig's per-family switches from raw config.json dicts (transformers 4 and 5)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from pdserve.common.errors import ModelLoadError
from pdserve.common.model import families
from pdserve.common.model.checkpoint.config import ModelConfig
from pdserve.common.model.registry import FAMILIES


def raw(model_type: str, **extra: Any) -> dict[str, Any]:
    return {
        "model_type": model_type,
        "vocab_size": 32,
        "hidden_size": 16,
        "intermediate_size": 32,
        "num_hidden_layers": 4,
        "num_attention_heads": 2,
        **extra,
    }


def test_llama_ignores_sliding_window_as_transformers_does() -> None:
    cfg = ModelConfig.from_dict(raw("llama", sliding_window=8, attention_bias=True))
    assert cfg.layer_windows == (None,) * 4
    assert cfg.attention_bias and cfg.o_proj_bias and not cfg.qk_norm


def test_mistral_windows_every_layer_unless_the_window_is_null() -> None:
    assert ModelConfig.from_dict(raw("mistral", sliding_window=8)).layer_windows == (8,) * 4
    assert ModelConfig.from_dict(raw("mistral", sliding_window=None)).layer_windows == (None,) * 4


def test_qwen2_window_needs_use_sliding_window_and_starts_at_max_window_layers() -> None:
    # Qwen2.5 ships sliding_window with use_sliding_window false: no window anywhere
    off = ModelConfig.from_dict(raw("qwen2", sliding_window=131072, use_sliding_window=False))
    assert off.layer_windows == (None,) * 4 and off.sliding_window is None
    assert ModelConfig.from_dict(raw("qwen2", sliding_window=8)).layer_windows == (None,) * 4
    # transformers 4 configs: no layer_types, derived from max_window_layers
    mix = raw("qwen2", sliding_window=8, use_sliding_window=True, max_window_layers=3)
    assert ModelConfig.from_dict(mix).layer_windows == (None, None, None, 8)
    # transformers 5 saves layer_types, which wins
    kinds = ["sliding_attention", "full_attention"] * 2
    given = ModelConfig.from_dict({**mix, "layer_types": kinds})
    assert given.layer_windows == (8, None, 8, None)
    qwen2 = ModelConfig.from_dict(raw("qwen2", attention_bias=False))
    assert qwen2.attention_bias and not qwen2.o_proj_bias  # Qwen2 biases q/k/v always


def test_qwen3_norms_q_and_k_and_keeps_its_own_head_dim() -> None:
    cfg = ModelConfig.from_dict(raw("qwen3", head_dim=32, attention_bias=True))
    assert cfg.qk_norm and cfg.head_dim == 32 and cfg.o_proj_bias and not cfg.mlp_bias


def test_unknown_layer_kinds_and_families_are_refused() -> None:
    bad = raw("qwen3", sliding_window=8, use_sliding_window=True, layer_types=["chunked"] * 4)
    with pytest.raises(ModelLoadError, match="layer_types"):
        ModelConfig.from_dict(bad)
    with pytest.raises(ModelLoadError, match="not supported"):
        ModelConfig.from_dict(raw("gemma2"))


def test_a_family_is_picked_by_model_type_else_by_architectures() -> None:
    by_arch = {**raw("qwen3"), "architectures": ["Qwen3ForCausalLM"]}
    del by_arch["model_type"]
    cfg = ModelConfig.from_dict(by_arch)
    assert (cfg.model_type, cfg.architecture, cfg.qk_norm) == ("qwen3", "Qwen3ForCausalLM", True)
    # transformers builds model_type's class: a stale architectures entry does not win
    stale = {**raw("mistral", sliding_window=8), "architectures": ["LlamaForCausalLM"]}
    cfg = ModelConfig.from_dict(stale)
    assert cfg.architecture == "MistralForCausalLM" and cfg.layer_windows == (8,) * 4
    assert ModelConfig.from_dict(raw("deepseek_v3")).architecture == "DeepseekV3ForCausalLM"
    unknown = {**raw("gemma2"), "architectures": ["Gemma2ForCausalLM"]}
    with pytest.raises(ModelLoadError) as err:
        ModelConfig.from_dict(unknown)
    assert str(err.value).startswith("model_type 'gemma2' is not supported; pdserve runs ")
    assert "Qwen3MoeForCausalLM (qwen3_moe)" in str(err.value)
    assert str(err.value).endswith("names architectures ['Gemma2ForCausalLM']")


def test_every_family_module_is_registered_and_reads_and_builds() -> None:
    """Adding a family is its module plus its registry line: no module without a line."""
    folder = Path(families.__file__).parent
    modules = {p.stem for p in folder.glob("*.py")} - {"__init__"}
    assert modules == {f.module for f in FAMILIES}
    for family in FAMILIES:
        module = family.load()
        assert callable(module.read_config) and callable(module.build_model), family
