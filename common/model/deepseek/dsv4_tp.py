"""DeepSeek-V4 under tensor parallelism: what a TP rank holds of each weight (torch-free
apart from the tensors it cuts).

* Attention: the query heads split (``attn.wq_b``'s rows, ``attn.attn_sink``) and with them
  the output groups, so ``o_groups`` must split over TP too: a rank's heads are then exactly
  the heads of its groups, whose blocks of ``attn.wo_a`` (rows) it holds, and ``attn.wo_b``
  is row-parallel (its columns of those groups; the partial sums all-reduced). The query's
  low-rank projection, the one K=V row, the compressors and CSA's indexer stay replicated:
  every rank writes the same cache rows and entries and its indexer keeps the same entries,
  as MLA's latent (common/model/layers/mla.py), so a decode rank reads the whole row from any
  producer copy (one "KV head": common/parallel/tp.py ``pull_plan``).
* Experts: expert parallel, as common/model/layers/moe.py: rank r holds the routed experts
  ``[r E / N, (r + 1) E / N)`` (the others' tensors dropped at load) and a 1/N slice of the
  shared expert's intermediate (its gate clamp and the up clamp are per value, so the
  slices compute what the whole does); the gate is replicated, so every rank routes alike,
  and one all-reduce sums the routed and shared partials.
* Hyper-connections, the embedding, the final norm and the head are replicated.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from pdserve.common.model.checkpoint.moe_config import local_experts

if TYPE_CHECKING:
    import torch

    from pdserve.common.model.checkpoint.config import ModelConfig

_EXPERT = re.compile(r"\.ffn\.experts\.(\d+)\.")


def check_v4_tp(cfg: ModelConfig, tp: int) -> str | None:
    """Why DeepSeek-V4 cannot split over ``tp`` ranks, or None when it can."""
    v4 = cfg.v4
    assert v4 is not None
    if cfg.num_attention_heads % tp:
        return f"{cfg.num_attention_heads} attention heads do not split over TP {tp}"
    if v4.o_groups % tp:
        return f"o_groups {v4.o_groups} (output projection groups) do not split over TP {tp}"
    if v4.num_experts % tp:
        return f"{v4.num_experts} experts do not split over TP {tp} (expert parallelism)"
    if v4.moe_intermediate_size % tp:
        return f"shared-expert size {v4.moe_intermediate_size} does not split over TP {tp}"
    return None


def shard_v4_state(
    state: dict[str, torch.Tensor], cfg: ModelConfig, tp: int, rank: int
) -> dict[str, torch.Tensor]:
    """The tensors TP rank ``rank`` holds, cut from a whole checkpoint's (its experts only)."""
    if tp == 1:
        return state
    v4 = cfg.v4
    assert v4 is not None
    heads = cfg.num_attention_heads // tp
    groups = v4.o_groups * v4.o_lora_rank // tp  # this rank's wo_a rows / wo_b columns
    inter = v4.moe_intermediate_size // tp
    first, count = local_experts(v4.num_experts, tp, rank)
    # (name suffix, dim, size of the rank's slice): dim 0 rows, dim 1 columns
    cuts = (
        (".attn.wq_b.weight", 0, heads * cfg.head_dim),
        (".attn.attn_sink", 0, heads),
        (".attn.wo_a.weight", 0, groups),
        (".attn.wo_b.weight", 1, groups),
        (".shared_experts.w1.weight", 0, inter),
        (".shared_experts.w3.weight", 0, inter),
        (".shared_experts.w2.weight", 1, inter),
    )
    out = {}
    for name, tensor in state.items():
        expert = _EXPERT.search(name)
        if expert is not None and not first <= int(expert[1]) < first + count:
            continue  # another rank's expert
        for suffix, dim, size in cuts:
            if name.endswith(suffix):
                tensor = tensor.narrow(dim, rank * size, size).contiguous()
                break
        out[name] = tensor
    return out
