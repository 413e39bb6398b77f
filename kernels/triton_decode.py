"""The Triton decode kernel (flash-decoding over splits of the context) and its reduction;
layouts, softmax and fp8 handling as in kernels/triton_common.py."""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from pdserve.kernels.fp8 import is_fp8
from pdserve.kernels.triton_common import (
    _INTERPRETED,
    _LOG2E,
    _attend_block,
    _check_attention,
    _device_guard,
    compute_dtype,
)


@triton.jit
def _decode_kernel(
    out_ptr,  # [S, H_q, D], written when SPLITS == 1
    q_ptr,  # [S, H_q, D] in the compute dtype (triton_common.compute_dtype)
    cache_ptr,  # [N, 2, H_kv, B, D]
    context_lens_ptr,  # [S]
    block_tables_ptr,  # [S, max_blocks]
    part_acc_ptr,  # [S, H_q, SPLITS, D] fp32: each split's unnormalised output
    part_ml_ptr,  # [S, H_q, SPLITS, 2] fp32: each split's running max and sum
    qk_scale,  # scale * log2(e)
    k_scale,  # fp8 caches: K = stored * k_scale
    v_scale,
    window,  # sliding window (ignored unless USE_WINDOW)
    stride_qs,
    stride_qh,
    stride_qd,
    stride_os,
    stride_oh,
    stride_od,
    stride_cn,
    stride_ckv,
    stride_ch,
    stride_cb,
    stride_cd,
    stride_bts,
    stride_btb,
    stride_as,
    stride_ah,
    stride_ap,
    stride_ms,
    stride_mh,
    stride_mp,
    GROUP: tl.constexpr,  # H_q // H_kv
    USE_WINDOW: tl.constexpr,
    BLOCK_G: tl.constexpr,  # GROUP padded to a power of two >= 16 (the rows of tl.dot)
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    SPLITS: tl.constexpr,  # programs per (sequence, kv head)
    FP8: tl.constexpr,
    UPCAST: tl.constexpr,
):
    # Program (sequence, kv head, split): the GROUP q heads that share the kv head are the
    # rows of one tile, so each K/V block is read once per kv head. With SPLITS > 1 the
    # sequence's visible blocks are cut into SPLITS equal runs (flash-decoding, so that a
    # small batch fills the GPU); each run's partial softmax goes to part_* for
    # _decode_reduce_kernel. The cut depends on the context length and SPLITS only, never on
    # the block tables' width: an eager step and a replayed CUDA graph agree bit for bit.
    seq = tl.program_id(0).to(tl.int64)
    # int64 offsets: a head-major cache of an 8B model passes 2^31 elements (#13).
    kv_head = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2)
    ctx = tl.load(context_lens_ptr + seq).to(tl.int32)
    q_pos = ctx - 1

    g = tl.arange(0, BLOCK_G)
    g_ok = g < GROUP
    heads = kv_head * GROUP + g  # [G]
    d = tl.arange(0, HEAD_DIM)
    q_ptrs = q_ptr + seq * stride_qs + heads[:, None] * stride_qh + d[None, :] * stride_qd
    q = tl.load(q_ptrs, mask=g_ok[:, None], other=0.0)  # [G, D]
    if UPCAST:
        q = q.to(tl.float32)

    hi = tl.cdiv(ctx, BLOCK_SIZE)
    lo = 0
    if USE_WINDOW:
        lo = tl.maximum(ctx - window, 0) // BLOCK_SIZE
    if SPLITS > 1:
        per_split = tl.cdiv(hi - lo, SPLITS)
        lo = lo + split * per_split
        hi = tl.minimum(hi, lo + per_split)

    m_i = tl.full([BLOCK_G], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, HEAD_DIM], tl.float32)
    offs_b = tl.arange(0, BLOCK_SIZE)
    # [B, D] pointers into block 0's K of this kv head; a block's K is block_id * stride_cn on.
    head_base = (
        cache_ptr + kv_head * stride_ch + offs_b[:, None] * stride_cb + d[None, :] * stride_cd
    )
    table = block_tables_ptr + seq * stride_bts
    for j in range(lo, hi):
        block_id = tl.load(table + j * stride_btb).to(tl.int64)
        k_pos = j * BLOCK_SIZE + offs_b  # [B]
        k_ok = k_pos < ctx
        visible = k_ok
        if USE_WINDOW:
            visible = visible & (k_pos > q_pos - window)
        visible = visible[None, :] & g_ok[:, None]  # [G, B]
        acc, m_i, l_i = _attend_block(
            q,
            acc,
            m_i,
            l_i,
            head_base + block_id * stride_cn,
            stride_ckv,
            k_ok,
            visible,
            qk_scale,
            k_scale,
            v_scale,
            FP8,
            UPCAST,
        )

    if SPLITS > 1:  # an empty split stores m = -1e30, l = 0, acc = 0: it weighs nothing
        acc_ptrs = part_acc_ptr + seq * stride_as + heads[:, None] * stride_ah + d[None, :]
        tl.store(acc_ptrs + split * stride_ap, acc, mask=g_ok[:, None])
        ml_ptrs = part_ml_ptr + seq * stride_ms + heads * stride_mh + split * stride_mp
        tl.store(ml_ptrs, m_i, mask=g_ok)
        tl.store(ml_ptrs + 1, l_i, mask=g_ok)
    else:
        # A padding row (g >= GROUP) or a context of 0 sees nothing and keeps acc = 0.
        l_i = tl.where(l_i == 0.0, 1.0, l_i)
        out = acc / l_i[:, None]
        o_ptrs = out_ptr + seq * stride_os + heads[:, None] * stride_oh + d[None, :] * stride_od
        tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=g_ok[:, None])


@triton.jit
def _decode_reduce_kernel(
    out_ptr,  # [S, H_q, D]
    part_acc_ptr,  # [S, H_q, SPLITS, D] fp32
    part_ml_ptr,  # [S, H_q, SPLITS, 2] fp32
    stride_os,
    stride_oh,
    stride_od,
    stride_as,
    stride_ah,
    stride_ap,
    stride_ms,
    stride_mh,
    stride_mp,
    HEAD_DIM: tl.constexpr,
    SPLITS: tl.constexpr,
    BLOCK_P: tl.constexpr,  # SPLITS rounded up to a power of two
):
    # One program per (sequence, query head): every split's partial softmax loaded as one
    # [SPLITS, D] tile and merged at their common max. (One program per KV head looping over
    # the splits left a batch of 1 eight programs of 32 dependent loads: 11 us a layer on
    # the H200, three times the decode kernel it follows.)
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    p = tl.arange(0, BLOCK_P)
    p_ok = p < SPLITS
    d = tl.arange(0, HEAD_DIM)
    ml_ptrs = part_ml_ptr + seq * stride_ms + head * stride_mh + p * stride_mp
    m_p = tl.load(ml_ptrs, mask=p_ok, other=-1.0e30)  # [P] each split's max (log2 units)
    l_p = tl.load(ml_ptrs + 1, mask=p_ok, other=0.0)  # [P] each split's sum
    alpha = tl.exp2(m_p - tl.max(m_p, axis=0))
    total = tl.sum(alpha * l_p, axis=0)
    acc_ptrs = part_acc_ptr + seq * stride_as + head * stride_ah + p[:, None] * stride_ap
    acc = tl.load(acc_ptrs + d[None, :], mask=p_ok[:, None], other=0.0)  # [P, D]
    out = tl.sum(alpha[:, None] * acc, axis=0)
    # A context of 0 sees nothing: its splits sum to 0 and it keeps acc = 0.
    out = out / tl.where(total == 0.0, 1.0, total)
    tl.store(out_ptr + seq * stride_os + head * stride_oh + d * stride_od,
             out.to(out_ptr.dtype.element_ty))  # fmt: skip


MAX_DECODE_SPLITS = 32


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def decode_splits(num_seqs: int, num_kv_heads: int, device: torch.device) -> int:
    """Programs per (sequence, kv head) for a decode step of ``num_seqs`` sequences: enough
    for two programs per SM (flash-decoding at small batches), 1 once the batch fills the
    GPU. The split changes the summation order, so a step and its CUDA-graph replay must
    ask with the same (padded) batch size (common/engine/model_runner.py does)."""
    if device.type != "cuda":  # Triton's interpreter (tests pass num_splits themselves)
        return 1
    index = device.index if device.index is not None else torch.cuda.current_device()
    wanted = triton.cdiv(2 * _num_sms(index), max(1, num_seqs * num_kv_heads))
    return max(1, min(MAX_DECODE_SPLITS, wanted))


def _decode_into(
    out: torch.Tensor,  # [S, H_q, D], fully overwritten
    q: torch.Tensor,
    layer_cache: torch.Tensor,
    context_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    sliding_window: int | None,
    num_splits: int | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    group, num_kv_heads, block_size, head_dim = _check_attention(q, layer_cache, sliding_window)
    assert out.shape == q.shape, f"out must be shaped like q {tuple(q.shape)}: {tuple(out.shape)}"
    num_seqs = q.shape[0]
    assert context_lens.shape[0] == num_seqs, "decode: one query token per sequence"
    if num_seqs == 0:
        return
    splits = num_splits or decode_splits(num_seqs, num_kv_heads, q.device)
    q = q.to(compute_dtype(q, layer_cache))
    context_lens = context_lens.contiguous()
    # [S, H_q, SPLITS, D] and [S, H_q, SPLITS, 2]; unused (never written) when SPLITS == 1
    part_acc = torch.empty(
        (num_seqs, q.shape[1], splits, head_dim), dtype=torch.float32, device=q.device
    )
    part_ml = torch.empty((num_seqs, q.shape[1], splits, 2), dtype=torch.float32, device=q.device)
    rows = dict(GROUP=group, BLOCK_G=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim)
    with _device_guard(q):
        _decode_kernel[(num_seqs, num_kv_heads, splits)](
            out,
            q,
            layer_cache,
            context_lens,
            block_tables,
            part_acc,
            part_ml,
            scale * _LOG2E,
            k_scale,
            v_scale,
            sliding_window or 0,
            *q.stride(),
            *out.stride(),
            *layer_cache.stride(),
            *block_tables.stride(),
            *part_acc.stride()[:3],
            *part_ml.stride()[:3],
            **rows,
            USE_WINDOW=sliding_window is not None,
            BLOCK_SIZE=block_size,
            SPLITS=splits,
            FP8=is_fp8(layer_cache.dtype),
            UPCAST=_INTERPRETED,
        )
        if splits > 1:
            _decode_reduce_kernel[(num_seqs, q.shape[1])](
                out,
                part_acc,
                part_ml,
                *out.stride(),
                *part_acc.stride()[:3],
                *part_ml.stride()[:3],
                HEAD_DIM=head_dim,
                SPLITS=splits,
                BLOCK_P=triton.next_power_of_2(splits),
            )


def decode_attention(
    q: torch.Tensor,  # [S, H_q, D], one query token per sequence
    layer_cache: torch.Tensor,  # [N, 2, H_kv, B, D]
    context_lens: torch.Tensor,  # [S] int, incl. the token being decoded
    block_tables: torch.Tensor,  # [S, max_blocks] int
    scale: float,
    sliding_window: int | None = None,
    num_splits: int | None = None,  # None: decode_splits() for this batch
    k_scale: float = 1.0,  # fp8 caches: K = stored * k_scale
    v_scale: float = 1.0,
) -> torch.Tensor:  # [S, H_q, D]
    out = torch.empty_like(q)
    _decode_into(
        out,
        q,
        layer_cache,
        context_lens,
        block_tables,
        scale,
        sliding_window,
        num_splits,
        k_scale,
        v_scale,
    )
    return out
