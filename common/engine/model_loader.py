"""Loading a checkpoint into this rank's model: the weights it holds (its experts, its TP
shard, no MTP layer), checked against the config's parameters, on its device."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from pdserve.common.engine.kv_groups import cache_groups
from pdserve.common.errors import ModelLoadError
from pdserve.common.model.checkpoint.config import ModelConfig
from pdserve.common.model.decoder import CausalLM
from pdserve.common.model.draft.mtp import read_weights
from pdserve.common.model.family_api import family_for
from pdserve.common.model.layers.meta import meta_modules
from pdserve.common.model.layers.moe import fuse_expert_weights
from pdserve.common.model.registry import family_named
from pdserve.common.parallel.context import ParallelContext

# kept in float32 whatever the model dtype (DeepSeek routes on them in float32, as HF does)
FLOAT32_KEYS = ("e_score_correction_bias",)


def check_device_supports(cfg: ModelConfig, device: torch.device) -> None:
    """Refuse, before any weight is read, a model whose family names ops its kernels lack
    on the device (common/model/family_api.py ``unsupported_ops``), each by name and why."""
    missing = family_for(cfg).unsupported_ops(cfg, device.type)
    if missing:
        ops = "; ".join(f"{op}: {why}" for op, why in missing.items())
        raise ModelLoadError(
            f"{cfg.model_type} on {device.type} needs ops pdserve lacks there: {ops} "
            "(it runs with --device cpu)"
        )


def load_model(
    cfg: ModelConfig,
    model_dir: Path,
    dtype: torch.dtype,
    device: torch.device,
    parallel: ParallelContext | None = None,
    cpu_weight_prepack: bool = False,
) -> CausalLM:
    check_device_supports(cfg, device)
    par = parallel or ParallelContext()
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"no *.safetensors weights in {model_dir}")
    # the model of the checkpoint's family (common/model/families/)
    build: Callable[[ModelConfig, ParallelContext], CausalLM]
    build = family_named(cfg.architecture).load().build_model
    with meta_modules():
        model = build(cfg, par)
    model.place_kv([(g.layers, g.rate) for g in cache_groups(cfg)])
    # MoE: only this rank's experts; DeepSeek's MTP layers not at all (common/model/draft/mtp.py)
    state = read_weights(files, cfg, model_dir, par.tp_size, par.tp_rank)
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    if cfg.moe is not None:  # per-expert tensors -> this rank's experts, stacked
        state = fuse_expert_weights(state, cfg.moe, par.tp_size, par.tp_rank)
    # this rank's TP cut, the family's (DeepSeek-V4: its own, this rank's experts only)
    state = family_for(cfg).shard_state(state, cfg, par.tp_size, par.tp_rank)
    expected = set(model.state_dict())
    if cfg.tie_word_embeddings:
        expected.discard("lm_head.weight")
    missing, unexpected = expected - set(state), set(state) - expected
    if missing or unexpected:
        raise ModelLoadError(
            f"weights in {model_dir} do not match the config: missing {sorted(missing)[:4]}, "
            f"unexpected {sorted(unexpected)[:4]}"
        )
    model.load_state_dict(
        {
            # integer tables (DeepSeek-V4's tid2eid) keep their dtype
            k: v.float()
            if k.endswith(FLOAT32_KEYS)
            else v.to(dtype)
            if v.is_floating_point()
            else v
            for k, v in state.items()
        },
        strict=False,
        assign=True,
    )
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model = model.to(device).eval()
    if device.type == "cuda":
        model.pack_weights()
    elif cpu_weight_prepack:  # float32 GEMMs on oneDNN-reordered weights (model/layers/linear.py)
        model.pack_weights(prepack=True)
    return model
