"""The parts of a Hugging Face Llama-family config.json that the model code needs.

One model implementation serves every family; what differs between them is a handful of
switches read here, each the way transformers' own config and model classes read it:

| model_type | q/k/v bias | o_proj bias | q/k norm | sliding window on |
| --- | --- | --- | --- | --- |
| llama | attention_bias | attention_bias | no | no layer (HF ignores sliding_window) |
| mistral | no | no | no | every layer, when sliding_window is set |
| qwen2 | always | no | no | layer_types, else layers >= max_window_layers if use_sliding_window |
| qwen3 | attention_bias | attention_bias | yes | as qwen2 |
| qwen3_moe | attention_bias | attention_bias | yes | every layer, when use_sliding_window |

DeepSeek V2/V3 (``deepseek_v2``, ``deepseek_v3``) are MLA models (common/model/mla.py): their
KV cache is one latent per token, so ``num_key_value_heads`` is 1 here (every query head
attends the one latent, replicated on every TP rank) and ``head_dim`` is the rope part
``qk_rope_head_dim`` (as transformers sets it); ``kv_cache_head_dim`` is the latent's width.
Layers from ``first_k_dense_replace`` on are MoE (common/model/moe.py).

Mixture-of-experts switches (which layers are sparse, the routing) are read by
common/model/moe_config.py into ``ModelConfig.moe``.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import msgspec

from pdserve.common.errors import ModelLoadError
from pdserve.common.model.moe_config import MoEConfig, moe_config

LLAMA_FAMILY = {"llama", "mistral", "qwen2", "qwen3", "qwen3_moe"}
QK_NORM = {"qwen3", "qwen3_moe"}
MLA_FAMILY = {"deepseek_v2", "deepseek_v3"}
FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"


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
    # The window W of the sliding layers (a query at p sees keys p - W < k <= p), None: none.
    sliding_window: int | None = None
    # Per layer FULL_ATTENTION or SLIDING_ATTENTION, as HF's ``config.layer_types``.
    layer_types: tuple[str, ...] = ()
    attention_bias: bool = False  # bias on q/k/v
    o_proj_bias: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim of each q and k head, before RoPE
    mlp_bias: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    moe: MoEConfig | None = None  # the experts of the sparse layers; None: every MLP dense

    def is_moe_layer(self, layer: int) -> bool:
        return self.moe is not None and layer in self.moe.sparse_layers

    # MLA (deepseek_v2/v3); kv_lora_rank 0: not an MLA model. q_lora_rank None: one q_proj.
    kv_lora_rank: int = 0
    q_lora_rank: int | None = None
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    # rope over interleaved pairs (x0, x1), (x2, x3)... (V3's rope_interleave; V2 always)
    rope_interleave: bool = False
    # DeepSeek's MTP layers after the model's own: not part of the model (model/mtp.py);
    # the speculative method mtp loads the first (model/mtp_layer.py)
    num_nextn_predict_layers: int = 0

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def kv_cache_head_dim(self) -> int:
        """Elements of one KV head of one token in the cache: head_dim, or for MLA the
        latent plus its rope part (kv_lora_rank + qk_rope_head_dim)."""
        return self.kv_lora_rank + self.qk_rope_head_dim if self.is_mla else self.head_dim

    @property
    def num_kv_parts(self) -> int:
        """2 (K and V) per KV head per token, 1 for MLA (the latent serves as both)."""
        return 1 if self.is_mla else 2

    @property
    def softmax_scale(self) -> float:
        """Attention's softmax scale; for MLA over the q/k head (nope + rope), times
        yarn's mscale(factor, mscale_all_dim) squared as transformers' DeepSeek applies it."""
        if not self.is_mla:
            return float(self.head_dim**-0.5)
        scale = float((self.qk_nope_head_dim + self.qk_rope_head_dim) ** -0.5)
        rope = self.rope_scaling or {}
        if rope.get("rope_type", "default") != "default" and rope.get("mscale_all_dim"):
            factor = float(rope["factor"])
            m = 1.0 if factor <= 1 else 0.1 * float(rope["mscale_all_dim"]) * math.log(factor) + 1
            scale *= m * m
        return scale

    def window_of(self, layer: int) -> int | None:
        """The sliding window of ``layer``, None for full attention."""
        if self.layer_types and self.layer_types[layer] == SLIDING_ATTENTION:
            return self.sliding_window
        return None

    @property
    def layer_windows(self) -> tuple[int | None, ...]:
        return tuple(self.window_of(i) for i in range(self.num_hidden_layers))

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        model_type = raw.get("model_type", "llama")
        if model_type in MLA_FAMILY:
            return cls._from_mla_dict(raw)
        if model_type not in LLAMA_FAMILY:
            raise ModelLoadError(
                f"model_type {model_type!r} is not supported; pdserve runs Llama-family "
                f"models ({', '.join(sorted(LLAMA_FAMILY))}) and dense MLA models "
                f"({', '.join(sorted(MLA_FAMILY))})"
            )
        num_heads = raw["num_attention_heads"]
        num_layers = raw["num_hidden_layers"]
        rope = _rope_parameters(raw)
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        window, layer_types = _attention_kinds(model_type, raw, num_layers)
        bias = raw.get("attention_bias", False)
        return cls(
            model_type=model_type,
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
            attention_bias={"qwen2": True, "mistral": False}.get(model_type, bias),
            o_proj_bias=bias and model_type in ("llama", *QK_NORM),
            qk_norm=model_type in QK_NORM,
            mlp_bias=model_type == "llama" and raw.get("mlp_bias", False),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=eos_ids,
            moe=moe_config(model_type, raw, num_layers),
        )

    @classmethod
    def _from_mla_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        """DeepseekV2Config / DeepseekV3Config as transformers reads them, dense layers only."""
        model_type = raw["model_type"]
        num_layers = raw["num_hidden_layers"]
        # transformers' defaults when the key is absent (V2: 0, V3: 3)
        dense = raw.get("first_k_dense_replace", 3 if model_type == "deepseek_v3" else 0)
        if model_type == "deepseek_v2" and (dense is None or dense < num_layers):
            raise ModelLoadError(
                f"{model_type}: layers {dense}..{num_layers - 1} are mixture-of-experts "
                f"(first_k_dense_replace={dense} < num_hidden_layers={num_layers}); pdserve "
                "routes DeepSeek-V3's experts (common/model/moe_config.py), not V2's"
            )
        rope_dim = raw.get("qk_rope_head_dim", 64)
        rope = _rope_parameters(raw)
        eos = raw.get("eos_token_id")
        bias = raw.get("attention_bias", False)
        return cls(
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
            mlp_bias=model_type == "deepseek_v2" and raw.get("mlp_bias", False),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,)),
            kv_lora_rank=raw.get("kv_lora_rank", 512),
            q_lora_rank=raw.get("q_lora_rank", 1536),
            qk_nope_head_dim=raw.get("qk_nope_head_dim", 128),
            qk_rope_head_dim=rope_dim,
            v_head_dim=raw.get("v_head_dim", 128),
            rope_interleave=model_type == "deepseek_v2" or raw.get("rope_interleave", True),
            moe=moe_config(model_type, raw, num_layers),
            # transformers' V3 default is 1 (its alias num_mtp_layers); V2 has none
            num_nextn_predict_layers=raw.get(
                "num_nextn_predict_layers",
                raw.get("num_mtp_layers", 1 if model_type == "deepseek_v3" else 0),
            )
            or 0,
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


def _attention_kinds(
    model_type: str, raw: dict[str, Any], num_layers: int
) -> tuple[int | None, tuple[str, ...]]:
    """(window, layer_types) as transformers decides them for ``model_type``."""
    full = (FULL_ATTENTION,) * num_layers
    window = raw.get("sliding_window")
    if model_type == "llama" or not window:
        return None, full
    if model_type == "mistral":  # MistralAttention passes config.sliding_window on every layer
        return window, (SLIDING_ATTENTION,) * num_layers
    if model_type == "qwen3_moe":  # Qwen3MoeConfig keeps the window only with use_sliding_window
        every = raw.get("use_sliding_window", False)
        return (window, (SLIDING_ATTENTION,) * num_layers) if every else (None, full)
    # Qwen2/Qwen3 (Qwen2Config.__post_init__): no window unless use_sliding_window; the
    # layer kinds from layer_types when given, else sliding from max_window_layers on.
    if not raw.get("use_sliding_window", False):
        return None, full
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
        return None, full
    return window, tuple(given)
