"""The Triton decode kernel (flash-decoding over splits of the context; the splits'
reduction and their number shared with the MLA decode in kernels/triton_common.py);
layouts, softmax and fp8 handling as in kernels/triton_common.py."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.kernels.fp8 import is_fp8
from pdserve.kernels.triton_common import (  # noqa: F401 - MAX_DECODE_SPLITS: re-exported
    _INTERPRETED,
    _LOG2E,
    MAX_DECODE_SPLITS,
    _attend_block,
    _check_attention,
    _device_guard,
    check_sinks,
    compute_dtype,
    decode_splits_for,
    finish_rows,
    reduce_splits,
    store_partials,
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
    sinks_ptr,  # [H_q] fp32 per-head sink logits (read when HAS_SINK and SPLITS == 1)
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
    HAS_SINK: tl.constexpr,
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

    if SPLITS > 1:
        store_partials(part_acc_ptr, part_ml_ptr, seq, heads, split, d, acc, m_i, l_i, g_ok,
                       stride_as, stride_ah, stride_ap, stride_ms, stride_mh, stride_mp)  # fmt: skip
    else:
        # A padding row (g >= GROUP) or a context of 0 sees nothing and keeps acc = 0.
        sink = m_i
        if HAS_SINK:
            sink = tl.load(sinks_ptr + heads, mask=g_ok, other=0.0) * 1.4426950408889634
        out = finish_rows(acc, m_i, l_i, sink, HAS_SINK)
        o_ptrs = out_ptr + seq * stride_os + heads[:, None] * stride_oh + d[None, :] * stride_od
        tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=g_ok[:, None])


def decode_splits(num_seqs: int, num_kv_heads: int, device: torch.device) -> int:
    """Programs per (sequence, kv head) for a decode step of ``num_seqs`` sequences
    (``triton_common.decode_splits_for``)."""
    return decode_splits_for(num_seqs * num_kv_heads, device)


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
    sinks: torch.Tensor | None = None,
) -> None:
    group, num_kv_heads, block_size, head_dim = _check_attention(q, layer_cache, sliding_window)
    assert out.shape == q.shape, f"out must be shaped like q {tuple(q.shape)}: {tuple(out.shape)}"
    num_seqs = q.shape[0]
    assert context_lens.shape[0] == num_seqs, "decode: one query token per sequence"
    if num_seqs == 0:
        return
    splits = num_splits or decode_splits(num_seqs, num_kv_heads, q.device)
    sinks = check_sinks(sinks, q.shape[1])
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
            part_ml if sinks is None else sinks,
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
            HAS_SINK=sinks is not None,
        )
    if splits > 1:
        reduce_splits(out, part_acc, part_ml, sinks, block_h=1)


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
    sinks: torch.Tensor | None = None,  # [H_q] per-head sink logits (DeepSeek-V4, gpt-oss)
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
        sinks,
    )
    return out
