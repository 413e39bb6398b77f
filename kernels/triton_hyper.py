"""DeepSeek-V4's hyper-connection mixing in one Triton kernel per call (the torch reference,
op for op as transformers: kernels/hyper_ref.py).

The reference is ~25 launches plus 4 per Sinkhorn iteration (20 by default: ~100 a call,
two calls a layer); here one program per token reads its streams row once for the RMS
factor and the projection through ``fn`` (the factor applied to the projected values: the
same sum, rounded in another order, float32), computes pre, post and the n x n ``comb``
with its Sinkhorn iterations in registers, and reads the row again (from L2) for the
collapsed input. ``HEAD``: the model head's collapse (``pre`` alone).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.kernels.triton_common import _device_guard


@triton.jit
def _hyper_kernel(
    streams_ptr,  # [T, N, H] contiguous rows
    fn_ptr,  # [M, N * H]: M = (2 + N) * N, or N (HEAD)
    base_ptr,  # [M]
    scale_ptr,  # [3], or [1] (HEAD)
    post_ptr,  # [T, N] fp32 (not HEAD)
    comb_ptr,  # [T, N, N] fp32 (not HEAD)
    out_ptr,  # [T, H] in the streams' dtype
    H,
    stride_t,
    stride_fm,
    eps,
    hc_eps,
    N: tl.constexpr,
    ITERS: tl.constexpr,  # Sinkhorn iterations
    HEAD: tl.constexpr,
    BLOCK_M: tl.constexpr,  # M padded to a power of two
    BLOCK_K: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    row = streams_ptr + t * stride_t
    K = N * H
    M: tl.constexpr = N if HEAD else (2 + N) * N
    rows = tl.arange(0, BLOCK_M)
    r_ok = rows < M
    k = tl.arange(0, BLOCK_K)
    proj = tl.zeros([BLOCK_M], tl.float32)
    ss = tl.zeros([BLOCK_K], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + k
        k_ok = kk < K
        x = tl.load(row + kk, mask=k_ok, other=0.0).to(tl.float32)
        ss += x * x
        w = tl.load(fn_ptr + rows[:, None] * stride_fm + kk[None, :],
                    mask=r_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)  # fmt: skip
        proj += tl.sum(w * x[None, :], axis=1)
    proj = proj * tl.rsqrt(tl.sum(ss, axis=0) / K + eps)

    i = tl.arange(0, N)
    # pre: rows [0, N)
    pre_w = tl.sum(tl.where(rows[None, :] == i[:, None], proj[None, :], 0.0), axis=1)  # [N]
    pre = tl.sigmoid(pre_w * tl.load(scale_ptr) + tl.load(base_ptr + i).to(tl.float32)) + hc_eps
    if not HEAD:
        post_w = tl.sum(tl.where(rows[None, :] == (N + i)[:, None], proj[None, :], 0.0), axis=1)
        post_b = tl.load(base_ptr + N + i).to(tl.float32)
        post = 2.0 * tl.sigmoid(post_w * tl.load(scale_ptr + 1) + post_b)
        tl.store(post_ptr + t * N + i, post)
        # comb [N, N]: row a, column b is proj[2N + a * N + b]
        ab = 2 * N + i[:, None] * N + i[None, :]  # [N, N]
        sel = rows[None, None, :] == ab[:, :, None]  # [N, N, BLOCK_M]
        comb_w = tl.sum(tl.where(sel, proj[None, None, :], 0.0), axis=2)
        logits = comb_w * tl.load(scale_ptr + 2) + tl.load(base_ptr + ab).to(tl.float32)
        logits = logits - tl.max(logits, axis=1)[:, None]
        e = tl.exp(logits)
        comb = e / tl.sum(e, axis=1)[:, None] + hc_eps
        comb = comb / (tl.sum(comb, axis=0)[None, :] + hc_eps)
        for _ in range(ITERS - 1):
            comb = comb / (tl.sum(comb, axis=1)[:, None] + hc_eps)
            comb = comb / (tl.sum(comb, axis=0)[None, :] + hc_eps)
        tl.store(comb_ptr + t * N * N + i[:, None] * N + i[None, :], comb)

    # the block's input: sum_i pre_i * stream_i, read again (from L2)
    d = tl.arange(0, BLOCK_K)
    for h0 in range(0, H, BLOCK_K):
        hh = h0 + d
        h_ok = hh < H
        x = tl.load(row + i[:, None] * H + hh[None, :], mask=h_ok[None, :], other=0.0)
        y = tl.sum(pre[:, None] * x.to(tl.float32), axis=0)
        tl.store(out_ptr + t * H + hh, y.to(out_ptr.dtype.element_ty), mask=h_ok)


def _launch(
    streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
    eps: float, hc_eps: float, iters: int, head: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    num_tokens, n, hidden = streams.shape
    assert n & (n - 1) == 0, f"hc_mult must be a power of two, got {n}"
    streams = streams.contiguous()
    rows = n if head else (2 + n) * n
    assert fn.shape == (rows, n * hidden) and fn.stride(1) == 1, tuple(fn.shape)
    out = torch.empty((num_tokens, hidden), dtype=streams.dtype, device=streams.device)
    post = torch.empty((num_tokens, n), dtype=torch.float32, device=streams.device)
    comb = torch.empty((num_tokens, n, n), dtype=torch.float32, device=streams.device)
    if num_tokens:
        with _device_guard(streams):
            _hyper_kernel[(num_tokens,)](
                streams,
                fn,
                base.contiguous(),
                scale.float().contiguous(),
                post,
                comb,
                out,
                hidden,
                streams.stride(0),
                fn.stride(0),
                eps,
                hc_eps,
                N=n,
                ITERS=iters,
                HEAD=head,
                BLOCK_M=triton.next_power_of_2(rows),
                BLOCK_K=128,
                num_warps=4,
            )
    return post, comb, out


def mix(
    streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
    eps: float, hc_eps: float, sinkhorn_iters: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    return _launch(streams, fn, base, scale, eps, hc_eps, sinkhorn_iters, head=False)


def collapse(
    streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
    eps: float, hc_eps: float,
) -> torch.Tensor:  # fmt: skip
    return _launch(streams, fn, base, scale, eps, hc_eps, 0, head=True)[2]
