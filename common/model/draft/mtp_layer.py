"""DeepSeek's multi-token-prediction (MTP) layer as a module, loaded from a checkpoint's
``model.layers.{num_hidden_layers}.*`` tensors (the speculative method ``mtp``,
common/engine/spec_decode/mtp.py).

For position i, with ``h_i`` the target's final hidden state before its final norm and
``t_{i+1}`` the token after position i (DeepSeek-V3's paper, section 2.2)::

    x_i     = eh_proj(cat[enorm(embed(t_{i+1})), hnorm(h_i)])
    h'_i    = decoder_layer(x_i)                 # its own attention over its own KV cache
    logits  = shared_head.head(shared_head.norm(h'_i))   # a guess of t_{i+2}

At position 0 the embedding is zeroed before ``enorm``, as vLLM's ``deepseek_mtp`` and
SGLang's NextN do. ``h'_i`` (before ``shared_head.norm``) stands in for the target's hidden state when the one
layer drafts a second token and further. The layer is a :class:`DecoderLayer` (its tensor
names are the checkpoint's once the ``model.layers.N.`` prefix is cut) of the target's parts
(``CausalLM.layer_parts``; DeepSeek: MLA attention and a dense MLP or routed experts).
``embed_tokens`` and ``shared_head.head`` are optional in the checkpoint: without them the
target's embedding and LM head serve (they are the same tensors in DeepSeek-V3's release).
"""

from __future__ import annotations

import re
from pathlib import Path

import msgspec
import torch
from torch import nn

from pdserve.common.errors import ModelLoadError
from pdserve.common.model.checkpoint.config import ModelConfig
from pdserve.common.model.decoder import CausalLM, DecoderLayer, LayerPart, pack_part
from pdserve.common.model.layers.attention import AttentionMetadata
from pdserve.common.model.layers.meta import meta_modules
from pdserve.common.model.layers.moe import fuse_expert_weights
from pdserve.common.model.layers.norm import RMSNorm
from pdserve.common.parallel.context import ParallelContext

OPTIONAL = ("embed_tokens.weight", "shared_head.head.weight")
FLOAT32_KEYS = ("e_score_correction_bias",)


class SharedHead(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)


class MTPLayer(DecoderLayer):
    def __init__(
        self,
        cfg: ModelConfig,
        par: ParallelContext,
        index: int,
        attention: LayerPart,  # the target's parts (CausalLM.layer_parts)
        mlp: LayerPart,
    ) -> None:
        super().__init__(cfg, par, index, attention, mlp)
        hidden = cfg.hidden_size
        self.enorm = RMSNorm(hidden, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(hidden, cfg.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * hidden, hidden, bias=False)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, hidden)
        self.shared_head = SharedHead(cfg)

    def predict(
        self,
        input_ids: torch.Tensor,  # [T]: t_{i+1}
        positions: torch.Tensor,  # [T]: i
        hidden: torch.Tensor,  # [T, hidden]: h_i (the target's, or this layer's own h'_{i-1})
        rope: tuple[torch.Tensor, torch.Tensor],  # cos, sin of positions i
        layer_cache: torch.Tensor,  # this layer's own KV cache
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [T, hidden]: h'_i, before shared_head.norm
        e = self.embed_tokens(input_ids)
        e = self.enorm(torch.where(positions[:, None] == 0, 0.0, e))  # vLLM's, SGLang's mask
        h = self.hnorm(hidden.to(e.dtype))
        x = self.eh_proj(torch.cat((e, h), dim=-1))
        out, residual = self(x, None, rope, layer_cache, meta)
        return out + residual

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [S, hidden] -> [S, vocab] fp32
        return self.shared_head.head(self.shared_head.norm(hidden)).float()

    def pack_weights(self) -> None:
        pack_part(self.self_attn)
        pack_part(self.mlp)


def mtp_layer_config(cfg: ModelConfig, keys: list[str]) -> ModelConfig:
    """``cfg`` with layer ``num_hidden_layers`` a MoE layer when its tensors hold experts
    (DeepSeek-V3's MTP layer is one; the model's ``sparse_layers`` stop before it)."""
    index = cfg.num_hidden_layers
    if not any(".mlp.experts." in k or k.endswith("mlp.gate.weight") for k in keys):
        return cfg
    if cfg.moe is None:
        raise ModelLoadError(
            f"the MTP layer model.layers.{index} holds routed experts but the config declares "
            "no mixture-of-experts"
        )
    moe = msgspec.structs.replace(cfg.moe, sparse_layers=(*cfg.moe.sparse_layers, index))
    return msgspec.structs.replace(cfg, moe=moe)


def read_mtp_tensors(files: list[Path], index: int) -> dict[str, torch.Tensor]:
    """Every tensor of layer ``index`` in the checkpoint's safetensors files (full names)."""
    from safetensors import safe_open

    pattern = re.compile(rf"^model\.layers\.{index}\.")
    out: dict[str, torch.Tensor] = {}
    for path in files:
        with safe_open(str(path), "pt", device="cpu") as f:
            for key in f.keys():  # noqa: SIM118 (a safe_open handle is not a dict)
                if pattern.match(key):
                    out[key] = f.get_tensor(key)
    return out


def load_mtp_layer(
    cfg: ModelConfig,
    model_dir: Path,
    target: CausalLM,
    dtype: torch.dtype,
    device: torch.device,
) -> MTPLayer:
    """The checkpoint's first MTP layer (one process, no tensor parallel), its embedding and
    LM head the target's where the checkpoint leaves them out."""
    if cfg.num_nextn_predict_layers < 1:
        raise ModelLoadError(
            f"speculative method 'mtp': {model_dir} has no multi-token-prediction layer "
            "(config.json: num_nextn_predict_layers is 0 or absent); use 'ngram' or "
            "'draft_model'"
        )
    index = cfg.num_hidden_layers
    prefix = f"model.layers.{index}."
    state = read_mtp_tensors(sorted(model_dir.glob("*.safetensors")), index)
    if not state:
        raise ModelLoadError(
            f"speculative method 'mtp': {model_dir} declares num_nextn_predict_layers="
            f"{cfg.num_nextn_predict_layers} but holds no tensors of its MTP layer "
            f"({prefix}*)"
        )
    layer_cfg = mtp_layer_config(cfg, list(state))
    if layer_cfg.moe is not None and layer_cfg.is_moe_layer(index):
        only = msgspec.structs.replace(layer_cfg.moe, sparse_layers=(index,))
        state = fuse_expert_weights(state, only)
    state = {k[len(prefix) :]: v for k, v in state.items()}
    with meta_modules():
        layer = MTPLayer(layer_cfg, ParallelContext(), index, *target.layer_parts)
    expected = set(layer.state_dict())
    missing = expected - set(state) - set(OPTIONAL)
    unexpected = set(state) - expected
    if missing or unexpected:
        raise ModelLoadError(
            f"the MTP layer {prefix}* in {model_dir} does not match the config: missing "
            f"{sorted(missing)[:4]}, unexpected {sorted(unexpected)[:4]}"
        )
    layer.load_state_dict(
        {k: v.float() if k.endswith(FLOAT32_KEYS) else v.to(dtype) for k, v in state.items()},
        strict=False,
        assign=True,
    )
    if "embed_tokens.weight" not in state:
        layer.embed_tokens = target.model.embed_tokens
    if "shared_head.head.weight" not in state:
        layer.shared_head.head = target.lm_head
    layer = layer.to(device).eval()
    if device.type == "cuda":
        layer.pack_weights()
    return layer
