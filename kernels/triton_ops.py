"""Triton kernels for the paged KV cache, with the signatures and semantics of reference.py:
``write_kv`` and prefill here, decode in ``triton_decode.py``, what they share (and the
fp8 rules) in ``triton_common.py``.

Layouts, the softmax, fp8 handling, the interpreter and the shape constraints: see
triton_common.py. Deviation from the reference: ``write_kv`` skips negative slots (the usual
padding marker); the reference would write them into the last block through negative
indexing.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.kernels.fp8 import FP8_MAX, is_fp8
from pdserve.kernels.triton_common import (
    _INTERPRETED,
    _LOG2E,
    _attend_block,
    _check_attention,
    _check_cache,
    _device_guard,
    compute_dtype,
)
from pdserve.kernels.triton_decode import (  # noqa: F401 - the module's public surface
    MAX_DECODE_SPLITS,
    _decode_into,
    decode_attention,
    decode_splits,
)


@triton.jit
def _write_kv_kernel(
    cache_ptr,  # [N, 2, H_kv, B, D]
    k_ptr,  # [T, H_kv, D] in the cache dtype (fp8 caches: in the model's, quantized here)
    v_ptr,  # [T, H_kv, D]
    slot_ptr,  # [T]
    inv_k_scale,  # fp8: stored = k * (1 / k_scale)
    inv_v_scale,
    stride_cn,
    stride_ckv,
    stride_ch,
    stride_cb,
    stride_cd,
    stride_kt,
    stride_kh,
    stride_kd,
    stride_vt,
    stride_vh,
    stride_vd,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    FP8: tl.constexpr,
    FP8_LIMIT: tl.constexpr,
):
    # One program per (token, kv head): copies one K row and one V row of D elements.
    # int64 offsets: a head-major cache of an 8B model passes 2^31 elements (#13).
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:
        block = slot // BLOCK_SIZE
        offset = slot % BLOCK_SIZE
        d = tl.arange(0, HEAD_DIM)
        k = tl.load(k_ptr + t * stride_kt + h * stride_kh + d * stride_kd)  # [D]
        v = tl.load(v_ptr + t * stride_vt + h * stride_vh + d * stride_vd)  # [D]
        if FP8:  # saturate: e4m3fn has no infinity, an overflow would store NaN
            k = tl.minimum(tl.maximum(k.to(tl.float32) * inv_k_scale, -FP8_LIMIT), FP8_LIMIT)
            v = tl.minimum(tl.maximum(v.to(tl.float32) * inv_v_scale, -FP8_LIMIT), FP8_LIMIT)
            k = k.to(cache_ptr.dtype.element_ty, fp_downcast_rounding="rtne")
            v = v.to(cache_ptr.dtype.element_ty, fp_downcast_rounding="rtne")
        dst = cache_ptr + block * stride_cn + h * stride_ch + offset * stride_cb + d * stride_cd
        tl.store(dst, k)
        tl.store(dst + stride_ckv, v)


@triton.jit
def _prefill_kernel(
    out_ptr,  # [T, H_q, D]
    q_ptr,  # [T, H_q, D] in the compute dtype (triton_common.compute_dtype)
    cache_ptr,  # [N, 2, H_kv, B, D]
    cu_seqlens_ptr,  # [S + 1]
    context_lens_ptr,  # [S]
    block_tables_ptr,  # [S, max_blocks]
    qk_scale,  # scale * log2(e)
    k_scale,  # fp8 caches: K = stored * k_scale
    v_scale,
    window,  # sliding window (ignored unless USE_WINDOW)
    stride_qt,
    stride_qh,
    stride_qd,
    stride_ot,
    stride_oh,
    stride_od,
    stride_cn,
    stride_ckv,
    stride_ch,
    stride_cb,
    stride_cd,
    stride_bts,
    stride_btb,
    GROUP: tl.constexpr,  # H_q // H_kv
    USE_WINDOW: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    FP8: tl.constexpr,
    UPCAST: tl.constexpr,
):
    # One program per (tile of BLOCK_M queries, sequence, q head).
    tile = tl.program_id(0)
    seq = tl.program_id(1)
    # int64 offsets: a head-major cache of an 8B model passes 2^31 elements (#13).
    head = tl.program_id(2).to(tl.int64)
    kv_head = head // GROUP

    q_start = tl.load(cu_seqlens_ptr + seq).to(tl.int64)
    q_len = (tl.load(cu_seqlens_ptr + seq + 1) - q_start).to(tl.int32)
    if tile * BLOCK_M >= q_len:
        return
    ctx = tl.load(context_lens_ptr + seq).to(tl.int32)

    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)  # [M] query index within the sequence
    row_ok = rows < q_len
    q_pos = ctx - q_len + rows  # [M] absolute positions
    d = tl.arange(0, HEAD_DIM)
    tokens = (q_start + rows)[:, None]  # [M, 1] rows of q and out
    q_ptrs = q_ptr + tokens * stride_qt + head * stride_qh + d[None, :] * stride_qd
    q = tl.load(q_ptrs, mask=row_ok[:, None], other=0.0)  # [M, D]
    if UPCAST:
        q = q.to(tl.float32)

    # Blocks [lo, hi) hold every key that some query of the tile can see.
    first_pos = ctx - q_len + tile * BLOCK_M
    last_pos = ctx - q_len + tl.minimum((tile + 1) * BLOCK_M, q_len) - 1
    hi = last_pos // BLOCK_SIZE + 1
    lo = 0
    if USE_WINDOW:
        lo = tl.maximum(first_pos - window + 1, 0) // BLOCK_SIZE

    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    offs_b = tl.arange(0, BLOCK_SIZE)
    # [B, D] pointers into block 0's K of this kv head; a block's K is block_id * stride_cn on.
    head_base = (
        cache_ptr + kv_head * stride_ch + offs_b[:, None] * stride_cb + d[None, :] * stride_cd
    )
    table = block_tables_ptr + seq * stride_bts
    for j in range(lo, hi):
        block_id = tl.load(table + j * stride_btb).to(tl.int64)
        k_pos = j * BLOCK_SIZE + offs_b  # [B]
        visible = k_pos[None, :] <= q_pos[:, None]  # [M, B]
        if USE_WINDOW:
            visible = visible & (k_pos[None, :] > q_pos[:, None] - window)
        acc, m_i, l_i = _attend_block(
            q,
            acc,
            m_i,
            l_i,
            head_base + block_id * stride_cn,
            stride_ckv,
            k_pos < ctx,
            visible,
            qk_scale,
            k_scale,
            v_scale,
            FP8,
            UPCAST,
        )

    # Padding rows (rows >= q_len) may have seen nothing; they are not stored.
    l_i = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc / l_i[:, None]
    o_ptrs = out_ptr + tokens * stride_ot + head * stride_oh + d[None, :] * stride_od
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


def write_kv(
    layer_cache: torch.Tensor,  # [N, 2, H_kv, B, D]
    k: torch.Tensor,  # [T, H_kv, D]
    v: torch.Tensor,  # [T, H_kv, D]
    slot_mapping: torch.Tensor,  # [T] int64, block_id * B + offset
    k_scale: float = 1.0,  # fp8 caches: stored = k / k_scale
    v_scale: float = 1.0,
) -> None:
    num_kv_heads, block_size, head_dim = _check_cache(layer_cache)
    num_tokens = k.shape[0]
    assert k.shape == v.shape == (num_tokens, num_kv_heads, head_dim), (
        f"k and v must be [T, {num_kv_heads}, {head_dim}], got {tuple(k.shape)}, {tuple(v.shape)}"
    )
    if num_tokens == 0:
        return
    slot_mapping = slot_mapping.contiguous()
    fp8 = is_fp8(layer_cache.dtype)
    if not fp8:
        k, v = k.to(layer_cache.dtype), v.to(layer_cache.dtype)
    with _device_guard(layer_cache):
        _write_kv_kernel[(num_tokens, num_kv_heads)](
            layer_cache,
            k,
            v,
            slot_mapping,
            1.0 / k_scale,
            1.0 / v_scale,
            *layer_cache.stride(),
            *k.stride(),
            *v.stride(),
            BLOCK_SIZE=block_size,
            HEAD_DIM=head_dim,
            FP8=fp8,
            FP8_LIMIT=FP8_MAX,
        )


def _prefill_into(
    out: torch.Tensor,  # [T, H_q, D], fully overwritten
    q: torch.Tensor,
    layer_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    sliding_window: int | None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    group, num_kv_heads, block_size, head_dim = _check_attention(q, layer_cache, sliding_window)
    assert out.shape == q.shape, f"out must be shaped like q {tuple(q.shape)}: {tuple(out.shape)}"
    num_seqs = context_lens.shape[0]
    if num_seqs == 0 or q.shape[0] == 0:
        return
    q = q.to(compute_dtype(q, layer_cache))
    cu_seqlens_q = cu_seqlens_q.contiguous()
    context_lens = context_lens.contiguous()
    # The grid needs the longest query run: one host sync, as in the reference.
    max_q_len = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max())
    if max_q_len == 0:
        return
    block_m = min(64, max(16, triton.next_power_of_2(max_q_len)))
    grid = (triton.cdiv(max_q_len, block_m), num_seqs, q.shape[1])
    with _device_guard(q):
        _prefill_kernel[grid](
            out,
            q,
            layer_cache,
            cu_seqlens_q,
            context_lens,
            block_tables,
            scale * _LOG2E,
            k_scale,
            v_scale,
            sliding_window or 0,
            *q.stride(),
            *out.stride(),
            *layer_cache.stride(),
            *block_tables.stride(),
            GROUP=group,
            USE_WINDOW=sliding_window is not None,
            BLOCK_M=block_m,
            BLOCK_SIZE=block_size,
            HEAD_DIM=head_dim,
            FP8=is_fp8(layer_cache.dtype),
            UPCAST=_INTERPRETED,
        )


def prefill_attention(
    q: torch.Tensor,  # [T, H_q, D], sequences concatenated
    layer_cache: torch.Tensor,  # [N, 2, H_kv, B, D], already holding the new K/V
    cu_seqlens_q: torch.Tensor,  # [S + 1] int, offsets of each sequence's queries in q
    context_lens: torch.Tensor,  # [S] int, cached tokens of each sequence incl. new ones
    block_tables: torch.Tensor,  # [S, max_blocks] int
    scale: float,
    sliding_window: int | None = None,
    k_scale: float = 1.0,  # fp8 caches: K = stored * k_scale
    v_scale: float = 1.0,
) -> torch.Tensor:  # [T, H_q, D]
    out = torch.empty_like(q)
    _prefill_into(
        out,
        q,
        layer_cache,
        cu_seqlens_q,
        context_lens,
        block_tables,
        scale,
        sliding_window,
        k_scale,
        v_scale,
    )
    return out
