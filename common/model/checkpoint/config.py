"""The parts of a Hugging Face config.json that the model code needs: ``ModelConfig``.

Every family reads its config.json into this one struct, in its own module
(common/model/families/, chosen by common/model/registry.py from the checkpoint's
``model_type`` and ``architectures``); the layers read only the fields. What the fields
mean for a family, and how transformers reads them for it, is told in that family's
module: the q/k/v and o_proj biases, Qwen3's per-head q/k norm, which layers slide a window
(``layer_types``), multi-head latent attention (``kv_lora_rank`` > 0: DeepSeek V2/V3, whose
KV cache is one latent per token, so ``num_key_value_heads`` is 1 and ``head_dim`` the rope
part), and the mixture-of-experts switches (common/model/checkpoint/moe_config.py, ``moe``).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec

from pdserve.common.errors import ModelLoadError
from pdserve.common.model.checkpoint.moe_config import MoEConfig
from pdserve.common.model.deepseek.dsv4_config import V4Config
from pdserve.common.model.registry import family_of

FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"


class ModelConfig(msgspec.Struct, frozen=True, kw_only=True):
    model_type: str = "llama"
    # the family's entry in common/model/registry.py: the module that builds the model
    architecture: str = "LlamaForCausalLM"
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
    # DeepSeek's MTP layers after the model's own: not part of the model (model/draft/mtp.py);
    # the speculative method mtp loads the first (model/draft/mtp_layer.py)
    num_nextn_predict_layers: int = 0
    # DeepSeek-V3.2's lightning indexer (common/model/deepseek/dsa.py): each query attends the
    # index_topk cached tokens its index_n_heads heads of index_head_dim score highest; its
    # key (index_head_dim values a token) is cached after the latent. 0: no indexer.
    index_topk: int = 0
    index_n_heads: int = 0
    index_head_dim: int = 0
    # DeepSeek-V4's own switches (common/model/deepseek/dsv4_config.py); None: not a V4 model
    v4: V4Config | None = None

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def is_indexed(self) -> bool:
        """DeepSeek-V3.2's sparse attention: a lightning indexer picks each query's keys."""
        return self.index_topk > 0

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
        """``raw`` (config.json) read by its family's module (common/model/registry.py)."""
        family = family_of(raw)
        read: Callable[[dict[str, Any]], ModelConfig] = family.load().read_config
        # a config may name only its architecture: the family's model_type then
        cfg = read({**raw, "model_type": family.model_type})
        return msgspec.structs.replace(cfg, architecture=family.architecture)

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


def rope_parameters(raw: dict[str, Any]) -> dict[str, Any]:
    """rope_theta plus scaling, from either transformers 4 (rope_theta + rope_scaling)
    or transformers 5 (rope_parameters) spelling. Plain RoPE leaves only rope_theta."""
    params = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    params.setdefault("rope_theta", raw.get("rope_theta", 10000.0))
    if "type" in params and "rope_type" not in params:
        params["rope_type"] = params.pop("type")
    if params.get("rope_type", "default") == "default":
        return {"rope_theta": params["rope_theta"]}
    return params


def eos_token_ids(raw: dict[str, Any]) -> tuple[int, ...]:
    """config.json's eos_token_id, one id or a list of them."""
    eos = raw.get("eos_token_id")
    return tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
