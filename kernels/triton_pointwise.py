"""Triton kernels for the model's pointwise ops, with the semantics of pointwise_ref.py.

One launch replaces the 8-10 small torch kernels of each op (RMSNorm with the residual
add, rotary embedding of q and k, SiLU-and-mul). Rounding follows the reference step by
step (each product or sum that torch rounds to the input dtype is rounded here too); the
differences are RMSNorm's mean of squares, summed in another order, and rotary's
multiply-adds, which the GPU compiler may fuse (one rounding where torch has two).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.kernels.triton_ops import _device_guard


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    res_out_ptr,
    stride_x,
    stride_r,
    stride_o,
    stride_ro,
    n_cols,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_r + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(res_out_ptr + row * stride_ro + cols, x, mask=mask)
    h = x.to(tl.float32)
    var = tl.sum(h * h, axis=0) / n_cols
    y = (h * tl.rsqrt(var + eps)).to(x_ptr.dtype.element_ty)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    out = (w.to(tl.float32) * y.to(tl.float32)).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * stride_o + cols, out, mask=mask)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    assert x.dim() == 2 and x.stride(1) == 1, (
        f"x must be [T, hidden] with unit column stride: {x.stride()}"
    )
    num_rows, n_cols = x.shape
    out_dtype = torch.promote_types(weight.dtype, x.dtype)
    out = torch.empty((num_rows, n_cols), dtype=out_dtype, device=x.device)
    res_out = None
    if residual is not None:
        assert residual.shape == x.shape and residual.stride(1) == 1 and residual.dtype == x.dtype
        res_out = torch.empty_like(x)
    if num_rows == 0:
        return out, res_out
    with _device_guard(x):
        _rms_norm_kernel[(num_rows,)](
            x,
            residual if residual is not None else x,
            weight,
            out,
            res_out if res_out is not None else out,
            x.stride(0),
            residual.stride(0) if residual is not None else 0,
            out.stride(0),
            res_out.stride(0) if res_out is not None else 0,
            n_cols,
            eps,
            HAS_RESIDUAL=residual is not None,
            BLOCK=triton.next_power_of_2(n_cols),
        )
    return out, res_out


@triton.jit
def _rotate(base, stride_h, num_heads, c1, c2, s1, s2, BLOCK_H: tl.constexpr, HALF: tl.constexpr):
    # The heads [BLOCK_H, HALF] x 2 of one token, rotated in place.
    h = tl.arange(0, BLOCK_H)
    i = tl.arange(0, HALF)
    ptrs = base + h[:, None] * stride_h + i[None, :]
    ok = (h < num_heads)[:, None]
    dt = base.dtype.element_ty
    x1 = tl.load(ptrs, mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(ptrs + HALF, mask=ok, other=0.0).to(tl.float32)
    # q * cos + rotate_half(q) * sin, each product and the sum rounded as torch rounds them
    o1 = (x1 * c1[None, :]).to(dt).to(tl.float32) + (-x2 * s1[None, :]).to(dt).to(tl.float32)
    o2 = (x2 * c2[None, :]).to(dt).to(tl.float32) + (x1 * s2[None, :]).to(dt).to(tl.float32)
    tl.store(ptrs, o1.to(dt), mask=ok)
    tl.store(ptrs + HALF, o2.to(dt), mask=ok)


@triton.jit
def _rotary_kernel(
    q_ptr,
    k_ptr,
    cos_ptr,
    sin_ptr,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_ct,
    stride_st,
    num_q_heads,
    num_k_heads,
    HALF: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HK: tl.constexpr,
):
    # One program per token: its cos / sin loaded once, then all of q's heads and k's.
    t = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, HALF)
    c1 = tl.load(cos_ptr + t * stride_ct + i).to(tl.float32)
    c2 = tl.load(cos_ptr + t * stride_ct + HALF + i).to(tl.float32)
    s1 = tl.load(sin_ptr + t * stride_st + i).to(tl.float32)
    s2 = tl.load(sin_ptr + t * stride_st + HALF + i).to(tl.float32)
    _rotate(q_ptr + t * stride_qt, stride_qh, num_q_heads, c1, c2, s1, s2, BLOCK_HQ, HALF)
    _rotate(k_ptr + t * stride_kt, stride_kh, num_k_heads, c1, c2, s1, s2, BLOCK_HK, HALF)


def rotary(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotates q and k in place (they may be views into one packed qkv row) and returns them."""
    num_tokens, num_q_heads, head_dim = q.shape
    assert k.shape[0] == num_tokens and k.shape[2] == head_dim and q.dtype == k.dtype
    assert q.stride(2) == 1 and k.stride(2) == 1, "q and k need unit stride along head_dim"
    assert head_dim % 2 == 0 and (head_dim // 2) & (head_dim // 2 - 1) == 0, (
        f"rotary kernel needs head_dim / 2 to be a power of two, got head_dim {head_dim}"
    )
    assert (
        cos.shape == sin.shape == (num_tokens, head_dim)
        and cos.stride(1) == 1
        and sin.stride(1) == 1
    )
    if num_tokens == 0:
        return q, k
    with _device_guard(q):
        _rotary_kernel[(num_tokens,)](
            q,
            k,
            cos.to(q.dtype),
            sin.to(q.dtype),
            q.stride(0),
            q.stride(1),
            k.stride(0),
            k.stride(1),
            cos.stride(0),
            sin.stride(0),
            num_q_heads,
            k.shape[1],
            HALF=head_dim // 2,
            BLOCK_HQ=triton.next_power_of_2(num_q_heads),
            BLOCK_HK=triton.next_power_of_2(k.shape[1]),
        )
    return q, k


@triton.jit
def _silu_and_mul_kernel(
    x_ptr,
    out_ptr,
    stride_x,
    stride_o,
    n_cols,
    limit,
    BLOCK: tl.constexpr,
    CLAMP: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    dt = out_ptr.dtype.element_ty
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    if CLAMP:  # DeepSeek-V4's experts: the gate clamped above, the up on both sides
        gate = tl.minimum(gate, limit)
        up = tl.minimum(tl.maximum(up, -limit), limit)
    act = (gate / (1.0 + tl.exp(-gate))).to(dt)
    tl.store(out_ptr + row * stride_o + cols, (act.to(tl.float32) * up).to(dt), mask=mask)


def silu_and_mul(gate_up: torch.Tensor, limit: float | None = None) -> torch.Tensor:
    assert gate_up.dim() == 2 and gate_up.stride(1) == 1 and gate_up.shape[1] % 2 == 0
    num_rows, n_cols = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty((num_rows, n_cols), dtype=gate_up.dtype, device=gate_up.device)
    if num_rows == 0:
        return out
    block = min(1024, triton.next_power_of_2(n_cols))
    with _device_guard(gate_up):
        _silu_and_mul_kernel[(num_rows, triton.cdiv(n_cols, block))](
            gate_up,
            out,
            gate_up.stride(0),
            out.stride(0),
            n_cols,
            0.0 if limit is None else float(limit),
            BLOCK=block,
            CLAMP=limit is not None,
        )
    return out
