"""DeepSeek's multi-token-prediction (MTP) layers in a checkpoint, and reading a checkpoint's
weights without them.

DeepSeek-V3 checkpoints carry ``num_nextn_predict_layers`` extra decoder layers after the
model's own (``model.layers.61.*`` in V3: ``enorm``, ``hnorm``, ``eh_proj``, ``shared_head``,
an embedding and a whole decoder layer with its experts), used only to draft tokens for
speculative decoding. The model itself never runs them (transformers ignores them at load).
The model itself is served without them: the target's load does not read their tensors and
logs which layers it skipped. The speculative method ``mtp`` loads the first of them on its
own (common/model/draft/mtp_layer.py, common/engine/spec_decode/mtp.py).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import structlog
import torch

from pdserve.common.model.checkpoint.config import ModelConfig
from pdserve.common.model.layers.moe import read_local_experts

log = structlog.get_logger("pdserve.model_runner")

_LAYER_KEY = re.compile(r"^model\.layers\.(\d+)\.")


def mtp_layers(cfg: ModelConfig) -> range:
    """Indices of the checkpoint's MTP layers: those after the model's own."""
    first = cfg.num_hidden_layers
    return range(first, first + cfg.num_nextn_predict_layers)


def mtp_key_filter(cfg: ModelConfig) -> Callable[[str], bool]:
    """True for a tensor name of an MTP layer (DeepSeek-V4 keeps its own, a NextN layer or
    a DSpark draft, under a top-level ``mtp.`` prefix)."""
    layers = mtp_layers(cfg)

    def is_mtp(key: str) -> bool:
        if key.startswith("mtp."):
            return True
        m = _LAYER_KEY.match(key)
        return m is not None and int(m[1]) in layers

    return is_mtp


def _keys_of(path: Path) -> list[str]:
    from safetensors import safe_open

    with safe_open(str(path), "pt", device="cpu") as f:
        return list(f.keys())


def _read(path: Path, skip: Callable[[str], bool]) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    with safe_open(str(path), "pt", device="cpu") as f:
        return {k: f.get_tensor(k) for k in f.keys() if not skip(k)}  # noqa: SIM118


def read_weights(
    files: list[Path], cfg: ModelConfig, model_dir: Path, tp_size: int = 1, tp_rank: int = 0
) -> dict[str, torch.Tensor]:
    """The tensors of a checkpoint's safetensors files, of a MoE model's routed experts only
    those TP rank ``tp_rank`` holds, without the MTP layers (logged when there were some)."""
    is_mtp = mtp_key_filter(cfg)
    state: dict[str, torch.Tensor] = {}
    num_mtp = 0
    for f in files:
        num_mtp += sum(1 for k in _keys_of(f) if is_mtp(k))
        if cfg.moe is None:
            state.update(_read(f, is_mtp))
        else:
            state.update(read_local_experts(f, cfg.moe, tp_size, tp_rank, is_mtp))
    if num_mtp:
        log.info(
            "mtp_layers_skipped",
            model=str(model_dir),
            layers=list(mtp_layers(cfg)),
            num_tensors=num_mtp,
            note="multi-token-prediction layers are not part of the model; only the "
            "speculative methods 'mtp' and 'dspark' (DeepSeek-V4) load them",
        )
    return state
