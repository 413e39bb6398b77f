"""The mixture-of-experts part of a Hugging Face config.json, read as transformers reads it.

Two routings, both ending in top-k experts per token with a weight each:

| model_type | scores | choice | weights |
| --- | --- | --- | --- |
| qwen3_moe | softmax of the router logits | top-k of the scores | the chosen scores, renormalised to sum 1 when ``norm_topk_prob`` |
| deepseek_v3 | sigmoid of the router logits | top-k of ``scores + e_score_correction_bias`` within the ``topk_group`` best of ``n_group`` groups (a group's score: the sum of its 2 best) | the chosen *uncorrected* scores, renormalised when ``norm_topk_prob``, times ``routed_scaling_factor`` |

Which layers are sparse: Qwen3-MoE, layer i unless ``i in mlp_only_layers`` and when
``(i + 1) % decoder_sparse_step == 0`` (``Qwen3MoeDecoderLayer``); DeepSeek-V3, layer i when
``i >= first_k_dense_replace`` (``DeepseekV3DecoderLayer``). The other layers keep the dense
MLP of ``intermediate_size``. DeepSeek's ``n_shared_experts`` shared experts form one dense
MLP of ``moe_intermediate_size * n_shared_experts`` added to the routed sum.
"""

from __future__ import annotations

from typing import Any

import msgspec

from pdserve.common.errors import ModelLoadError

SOFTMAX = "softmax"
SIGMOID = "sigmoid"


class MoEConfig(msgspec.Struct, frozen=True, kw_only=True):
    num_experts: int  # routed experts
    top_k: int  # experts per token
    intermediate_size: int  # of one expert
    norm_topk_prob: bool
    scoring: str = SOFTMAX  # SOFTMAX (Qwen3-MoE) or SIGMOID (DeepSeek-V3)
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    num_shared_experts: int = 0
    sparse_layers: tuple[int, ...] = ()  # the layers whose MLP is this MoE

    @property
    def shared_intermediate_size(self) -> int:
        return self.intermediate_size * self.num_shared_experts


def _experts(raw: dict[str, Any], *names: str, default: int | None = None) -> int:
    for name in names:  # hub configs and transformers' save_pretrained spell it differently
        if raw.get(name) is not None:
            return int(raw[name])
    if default is not None:
        return default
    raise KeyError(names[0])


def qwen3_moe_experts(raw: dict[str, Any], num_layers: int) -> MoEConfig | None:
    """Qwen3-MoE's experts (``Qwen3MoeConfig``), None when no layer is sparse."""
    num_experts = _experts(raw, "num_experts", "num_local_experts")
    step = raw.get("decoder_sparse_step", 1)
    dense = set(raw.get("mlp_only_layers") or [])
    sparse = tuple(
        i for i in range(num_layers) if i not in dense and num_experts > 0 and (i + 1) % step == 0
    )
    if not sparse:
        return None
    cfg = MoEConfig(
        num_experts=num_experts,
        top_k=raw.get("num_experts_per_tok", 8),
        intermediate_size=raw.get("moe_intermediate_size", 768),
        norm_topk_prob=raw.get("norm_topk_prob", False),
        sparse_layers=sparse,
    )
    return _checked(cfg)


def deepseek_v3_experts(raw: dict[str, Any], num_layers: int) -> MoEConfig | None:
    """DeepSeek-V3's experts (``DeepseekV3Config``), None when no layer is sparse."""
    first_dense = raw.get("first_k_dense_replace", 3) or 0
    sparse = tuple(range(first_dense, num_layers))
    if not sparse:
        return None
    cfg = MoEConfig(
        # DeepseekV3Config's default when the key is absent: 256 routed experts
        num_experts=_experts(raw, "n_routed_experts", "num_local_experts", default=256),
        top_k=raw.get("num_experts_per_tok", 8),
        intermediate_size=raw.get("moe_intermediate_size", 2048),
        norm_topk_prob=raw.get("norm_topk_prob", True),
        scoring=SIGMOID,
        n_group=raw.get("n_group") or 1,
        topk_group=raw.get("topk_group") or 1,
        routed_scaling_factor=raw.get("routed_scaling_factor", 2.5),
        num_shared_experts=raw.get("n_shared_experts") or 0,
        sparse_layers=sparse,
    )
    return _checked(cfg)


def _checked(cfg: MoEConfig) -> MoEConfig:
    if not 0 < cfg.top_k <= cfg.num_experts:
        raise ModelLoadError(
            f"num_experts_per_tok {cfg.top_k} must be between 1 and the {cfg.num_experts} experts"
        )
    if cfg.num_experts % cfg.n_group:
        raise ModelLoadError(f"{cfg.num_experts} experts do not split into n_group {cfg.n_group}")
    per_group = cfg.num_experts // cfg.n_group
    if cfg.scoring == SIGMOID and (
        not 0 < cfg.topk_group <= cfg.n_group or cfg.top_k > cfg.topk_group * per_group
    ):
        raise ModelLoadError(
            f"topk_group {cfg.topk_group} of n_group {cfg.n_group} groups of {per_group} "
            f"experts cannot hold num_experts_per_tok {cfg.top_k}"
        )
    return cfg


def check_ep(tp: int, moe: MoEConfig | None) -> str | None:
    """Why expert parallelism over ``tp`` ranks cannot split this model, or None."""
    if moe is None or tp <= 1:
        return None
    if moe.num_experts % tp:
        return f"{moe.num_experts} experts do not split over TP {tp} (expert parallelism)"
    if moe.shared_intermediate_size % tp:
        return f"shared-expert MLP size {moe.shared_intermediate_size} does not split over TP {tp}"
    return None


def local_experts(num_experts: int, tp: int, rank: int) -> tuple[int, int]:
    """(first, count) of the whole experts TP rank ``rank`` holds: a contiguous run."""
    per = num_experts // tp
    return rank * per, per
