"""Routed-expert compute, the torch reference: a loop over the experts that tokens chose.

Arithmetic op for op as transformers' ``Qwen3MoeExperts`` / ``DeepseekV3Experts``: experts
in ascending order, each expert's (top-k slot, token) pairs in that order, ``index_add_`` of
``down(silu(gate) * up) * weight`` into a zero tensor, so float32 sums match HF's bit for bit.
Under expert parallelism a rank holds experts ``[first_expert, first_expert + E)`` and adds
only their share; the TP all-reduce sums the ranks' shares.
"""

from __future__ import annotations

import torch
from torch.nn import functional as F


def moe_experts(
    x: torch.Tensor,  # [T, H]
    topk_ids: torch.Tensor,  # [T, k] int64, global expert ids
    topk_weights: torch.Tensor,  # [T, k]
    gate_up: torch.Tensor,  # [E, 2I, H]: rows [0, I) gate, [I, 2I) up
    down: torch.Tensor,  # [E, H, I]
    first_expert: int = 0,
    limit: float | None = None,  # DeepSeek-V4's swiglu_limit: gate clamped above, up both sides
) -> torch.Tensor:  # [T, H], the weighted sum over this rank's experts
    out = torch.zeros_like(x)
    num_local = gate_up.shape[0]
    local = topk_ids - first_expert  # [T, k]
    hit = torch.unique(local[(local >= 0) & (local < num_local)]).tolist()
    mask = local.t()  # [k, T]: HF walks slot-major
    for expert in hit:
        slot, token = torch.where(mask == expert)
        gate, up = F.linear(x[token], gate_up[expert]).chunk(2, dim=-1)
        if limit is not None:
            gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
        y = F.linear(F.silu(gate) * up, down[expert])
        y = y * topk_weights[token, slot, None]
        out.index_add_(0, token, y.to(out.dtype))
    return out
