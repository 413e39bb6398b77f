"""DeepSeek-V4's hyper-connection mixing, the torch reference: transformers'
``DeepseekV4HyperConnection`` (and its head's collapse) op for op, float32 throughout.

The residual is ``n`` streams [T, n, hidden]. Before a block the streams' flattened rows,
RMS-normalised (no weight), project through ``fn`` to per token ``pre`` (sigmoid, plus
``hc_eps``: each stream's weight into the block's input), ``post`` (2 sigmoid: the block
output's weight into each stream) and ``comb`` (softmax over its rows, then Sinkhorn-Knopp
towards a doubly stochastic n x n matrix); the block's input is ``sum_i pre_i * stream_i``.
The model's head keeps only ``pre`` (``collapse``).
"""

from __future__ import annotations

import torch
from torch.nn import functional as F


def _rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    # transformers' DeepseekV4UnweightedRMSNorm (x is float32 here)
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


def mix(
    streams: torch.Tensor,  # [T, n, hidden]
    fn: torch.Tensor,  # [(2 + n) * n, n * hidden]
    base: torch.Tensor,  # [(2 + n) * n]
    scale: torch.Tensor,  # [3]
    eps: float,  # the RMS norm's
    hc_eps: float,
    sinkhorn_iters: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # post [T, n], comb [T, n, n], input
    n = streams.shape[1]
    mixed = F.linear(_rms(streams.flatten(1).float(), eps), fn.float())
    pre_w, post_w, comb_w = mixed.split([n, n, n * n], dim=-1)
    pre_b, post_b, comb_b = base.split([n, n, n * n])
    pre_s, post_s, comb_s = scale.unbind(0)
    pre = torch.sigmoid(pre_w * pre_s + pre_b) + hc_eps
    post = 2 * torch.sigmoid(post_w * post_s + post_b)
    comb = torch.softmax(comb_w.unflatten(-1, (n, n)) * comb_s + comb_b.view(n, n), dim=-1)
    comb = comb + hc_eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)
    for _ in range(sinkhorn_iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + hc_eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)
    collapsed = (pre[..., None] * streams).sum(dim=1).to(streams.dtype)
    return post, comb, collapsed


def collapse(
    streams: torch.Tensor,  # [T, n, hidden]
    fn: torch.Tensor,  # [n, n * hidden]
    base: torch.Tensor,  # [n]
    scale: torch.Tensor,  # [1]
    eps: float,
    hc_eps: float,
) -> torch.Tensor:  # [T, hidden]
    """The head's collapse of the streams (``model.hc_head``)."""
    mixes = F.linear(_rms(streams.flatten(1).float(), eps), fn.float())
    pre = torch.sigmoid(mixes * scale.float() + base.float()) + hc_eps
    return (pre[..., None] * streams).sum(dim=1).to(streams.dtype)


def combine(
    streams: torch.Tensor,  # [T, n, hidden]
    post: torch.Tensor,  # [T, n] fp32
    comb: torch.Tensor,  # [T, n, n] fp32
    out: torch.Tensor,  # [T, hidden]: the block's output
) -> torch.Tensor:  # [T, n, hidden]
    """The streams after a block: ``post * out + comb^T @ streams`` in the streams' dtype
    (transformers' DeepseekV4DecoderLayer, op for op)."""
    dtype = streams.dtype
    return post.to(dtype)[..., None] * out[:, None, :] + torch.matmul(
        comb.to(dtype).transpose(-1, -2), streams
    )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' DeepseekV4RMSNorm (dsv4_attention's ``RMSNorm``): float32, the weight
    applied before the cast back."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (weight * h).to(x.dtype)


def step(
    streams: torch.Tensor,  # [T, n, hidden]
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    eps: float,
    hc_eps: float,
    sinkhorn_iters: int,
    *,
    prev: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,  # post, comb, out
    norm: tuple[torch.Tensor, float] | None = None,  # RMSNorm (weight, eps)
    head: bool = False,
    rows: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor]:
    """kernels/triton_hyper.py ``step`` in these ops: the previous block's combine, the mix
    (or the head's collapse) of the rows kept, the block's norm. (streams, post, comb, input;
    post and comb None for the head)."""
    if prev is not None:
        streams = combine(streams, *prev)
    kept = streams if rows is None else streams[rows]
    post = comb = None
    if head:
        x = collapse(kept, fn, base, scale, eps, hc_eps)
    else:
        post, comb, x = mix(kept, fn, base, scale, eps, hc_eps, sinkhorn_iters)
    if norm is not None:
        x = rms_norm(x, *norm)
    return kept, post, comb, x
