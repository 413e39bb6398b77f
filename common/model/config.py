"""The parts of a Hugging Face Llama-family config.json that the model code needs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgspec

from pdserve.common.errors import ModelLoadError

LLAMA_FAMILY = {"llama", "mistral", "qwen2"}


class ModelConfig(msgspec.Struct, frozen=True, kw_only=True):
    model_type: str = "llama"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    # HF's rope_scaling dict ({"rope_type": "llama3", "factor": ..., ...}), None for plain RoPE.
    rope_scaling: dict[str, Any] | None = None
    tie_word_embeddings: bool = False
    sliding_window: int | None = None
    attention_bias: bool = False
    mlp_bias: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        model_type = raw.get("model_type", "llama")
        if model_type not in LLAMA_FAMILY:
            raise ModelLoadError(
                f"model_type {model_type!r} is not supported; pdserve runs Llama-family "
                f"models ({', '.join(sorted(LLAMA_FAMILY))})"
            )
        num_heads = raw["num_attention_heads"]
        rope = _rope_parameters(raw)
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        # Mistral/Qwen2 configs carry sliding_window but may switch it off.
        window = raw.get("sliding_window") if raw.get("use_sliding_window", True) else None
        return cls(
            model_type=model_type,
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_hidden_layers=raw["num_hidden_layers"],
            num_attention_heads=num_heads,
            num_key_value_heads=raw.get("num_key_value_heads") or num_heads,
            head_dim=raw.get("head_dim") or raw["hidden_size"] // num_heads,
            max_position_embeddings=raw.get("max_position_embeddings", 2048),
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope_theta=rope.pop("rope_theta", 10000.0),
            rope_scaling=rope or None,
            tie_word_embeddings=raw.get("tie_word_embeddings", False),
            sliding_window=window,
            attention_bias=raw.get("attention_bias", model_type == "qwen2"),
            mlp_bias=raw.get("mlp_bias", False),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )

    @classmethod
    def from_dir(cls, path: Path) -> ModelConfig:
        try:
            raw = json.loads((path / "config.json").read_text())
        except (OSError, ValueError) as exc:
            raise ModelLoadError(f"cannot read {path / 'config.json'}: {exc}") from exc
        try:
            return cls.from_dict(raw)
        except KeyError as exc:
            raise ModelLoadError(f"{path / 'config.json'} lacks the key {exc}") from exc


def _rope_parameters(raw: dict[str, Any]) -> dict[str, Any]:
    """rope_theta plus scaling, from either transformers 4 (rope_theta + rope_scaling)
    or transformers 5 (rope_parameters) spelling. Plain RoPE leaves only rope_theta."""
    params = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    params.setdefault("rope_theta", raw.get("rope_theta", 10000.0))
    if "type" in params and "rope_type" not in params:
        params["rope_type"] = params.pop("type")
    if params.get("rope_type", "default") == "default":
        return {"rope_theta": params["rope_theta"]}
    return params
