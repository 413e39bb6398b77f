"""Routed-expert compute on CUDA: tokens sorted by expert, one grouped GEMM per projection.

The T x k (token, expert) pairs are sorted by local expert id (pairs whose expert lives on
another rank sort last and are dropped); ``torch._grouped_mm`` then runs gate/up for all
experts in one call (rows of expert e between ``offs[e-1]`` and ``offs[e]``), SiLU-and-mul,
and down in a second call; each row is scaled by its routing weight and ``index_add_``-ed
back to its token. Everything stays on the device with static shapes (no host sync, no
Python loop over experts), so a decode step can be captured in a CUDA graph.

:func:`available` says whether this call takes this path on CUDA (sm90+, bfloat16 or
float32; seen on an H200 with torch 2.11: both dtypes, a transposed B, and bfloat16 under
CUDA-graph capture; float32's grouped GEMM is a fallback that reads ``offs`` on the host, so
under capture float32 rows multiply by their expert's gathered weights instead);
elsewhere the caller uses the loop of :mod:`pdserve.kernels.moe_ref`. The function itself
also runs on CPU (torch's own grouped matmul), which is how CPU tests check it.
"""

from __future__ import annotations

import functools

import torch


def available(x: torch.Tensor, gate_up: torch.Tensor) -> bool:
    if x.device.type != "cuda" or not hasattr(torch, "_grouped_mm"):
        return False
    if x.dtype not in (torch.bfloat16, torch.float32) or gate_up.dtype != x.dtype:
        return False
    return _sm_major(x.device.index or 0) >= 9


@functools.cache
def _sm_major(device_index: int) -> int:  # once per device, not once per layer and step
    return torch.cuda.get_device_capability(device_index)[0]


def sort_by_expert(
    topk_ids: torch.Tensor,  # [T, k] global expert ids
    num_local: int,
    first_expert: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(order [T*k]: pair indices sorted by local expert, non-local last; valid [T*k] bool
    per sorted row; offs [E] int32: end row of each local expert's group)."""
    local = topk_ids.flatten() - first_expert  # [T*k]
    valid = (local >= 0) & (local < num_local)
    key = torch.where(valid, local, num_local)  # non-local pairs to a last bucket
    order = torch.argsort(key, stable=True)
    counts = torch.zeros(num_local + 1, dtype=torch.int32, device=key.device)
    counts.scatter_add_(0, key, torch.ones_like(key, dtype=torch.int32))
    offs = torch.cumsum(counts[:num_local], 0, dtype=torch.int32)
    return order, valid[order], offs


def moe_experts(
    x: torch.Tensor,  # [T, H] bfloat16
    topk_ids: torch.Tensor,  # [T, k] int64, global expert ids
    topk_weights: torch.Tensor,  # [T, k]
    gate_up: torch.Tensor,  # [E, 2I, H]: rows [0, I) gate, [I, 2I) up
    down: torch.Tensor,  # [E, H, I]
    first_expert: int = 0,
    limit: float | None = None,  # DeepSeek-V4's swiglu_limit (kernels.silu_and_mul)
) -> torch.Tensor:  # [T, H]
    from pdserve import kernels

    num_tokens, top_k = topk_ids.shape
    order, valid, offs = sort_by_expert(topk_ids, gate_up.shape[0], first_expert)
    token = order // top_k  # [T*k] the token of each sorted row
    xs = x[token]  # [T*k, H]
    # [E, 2I, H] viewed [E, H, 2I] (column-major B, what the grouped GEMM wants)
    if x.dtype == torch.bfloat16 or not _capturing(x):
        h = torch._grouped_mm(xs, gate_up.transpose(1, 2), offs=offs)  # [T*k, 2I]
        h = kernels.silu_and_mul(h, limit)  # [T*k, I]
        y = torch._grouped_mm(h, down.transpose(1, 2), offs=offs)  # [T*k, H]
    else:
        # float32's grouped GEMM is torch's fallback, which reads offs on the host: inside
        # a CUDA graph (decode) each row multiplies by its own expert's gathered weights
        expert = (topk_ids.flatten()[order] - first_expert).clamp(0, gate_up.shape[0] - 1)
        h = kernels.silu_and_mul(_rows_mm(xs, gate_up, expert), limit)
        y = _rows_mm(h, down, expert)
    # rows past offs[-1] (other ranks' experts) were not computed: zero them, not scale them
    # (masked_fill, not torch.where with a Python 0: no host tensor inside a CUDA graph)
    # (masked in y's dtype, then multiplied into float32 in the same pass: one [T*k, H] pass
    # fewer than casting first; the values are the same)
    w = topk_weights.flatten()[order].float()
    y = y.masked_fill(~valid[:, None], 0.0) * w[:, None]
    # the k experts of a token summed in fp32: index_add_ adds in any order (atomics), and
    # bf16 sums would then round differently from one run (or graph replay) to the next
    out = torch.zeros((num_tokens, x.shape[1]), dtype=torch.float32, device=x.device)
    return out.index_add_(0, token, y).to(x.dtype)


def _rows_mm(a: torch.Tensor, w: torch.Tensor, expert: torch.Tensor) -> torch.Tensor:
    """Row r of ``a`` [N, K] times ``w[expert[r]]`` [M, K] transposed: [N, M], one batched
    GEMM over gathered weights (decode-sized N; no host read)."""
    return torch.bmm(w[expert], a.unsqueeze(-1)).squeeze(-1)


def _capturing(x: torch.Tensor) -> bool:
    return x.device.type == "cuda" and torch.cuda.is_current_stream_capturing()
