"""Triton prefill attention over the paged KV cache, with the signature and semantics of
``reference.prefill_attention`` (layouts, softmax, fp8 and interpreter rules: see
triton_common.py).

One program takes a tile of ``BLOCK_T`` consecutive queries of one sequence and every query
head of one KV head (the GQA group): its ``BLOCK_T * GROUP_P`` rows are (query, head) pairs,
query-major, so each K/V block is loaded once for the whole group rather than once per
query head, and a group of 4 fills a 128-row tile from 32 queries. ``GROUP_P`` is the group
rounded up to a power of two (``tl.arange`` needs one); the padding rows are masked.

The key blocks a tile walks fall into at most three runs: blocks every row sees whole
(before the tile's first query, inside the window of its last one) are loaded and scored
without masks; the blocks at the edges (the diagonal, where the causal mask cuts, and the
window's start) are masked.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pdserve.kernels.fp8 import is_fp8
from pdserve.kernels.triton_common import (
    _INTERPRETED,
    _LOG2E,
    _check_attention,
    _device_guard,
    _load_kv,
    _softmax_step,
    compute_dtype,
)


@dataclass(frozen=True)
class PrefillConfig:
    """Launch shape of the prefill kernel: ``rows`` (query, head) pairs per program (a power
    of two >= 16), ``num_warps`` and ``num_stages`` (Triton's software pipelining)."""

    rows: int = 64
    num_warps: int = 4
    num_stages: int = 3


def default_config(max_q_len: int, group: int) -> PrefillConfig:
    """The launch shape for a prefill: 64-row tiles, 4 warps, 3 stages (on the H100 at the 8B
    shape the fastest of 64/128/256 rows, 4/8 warps, 1-3 stages for 2k-8k prompts:
    benchmarks/gpu_prefill_attention.py), smaller tiles for short query runs."""
    group_p = triton.next_power_of_2(group)
    rows = max(16, min(64, group_p * triton.next_power_of_2(max(1, max_q_len))))
    return PrefillConfig(rows=max(rows, group_p))


@triton.jit
def _prefill_gqa_kernel(
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
    GROUP_P: tl.constexpr,  # GROUP rounded up to a power of two
    USE_WINDOW: tl.constexpr,
    BLOCK_T: tl.constexpr,  # queries per program; BLOCK_T * GROUP_P rows
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    FP8: tl.constexpr,
    UPCAST: tl.constexpr,
):
    # One program per (tile of BLOCK_T queries, sequence, KV head).
    tile = tl.program_id(0)
    seq = tl.program_id(1)
    # int64 offsets: a head-major cache of an 8B model passes 2^31 elements (#13).
    kv_head = tl.program_id(2).to(tl.int64)

    q_start = tl.load(cu_seqlens_ptr + seq).to(tl.int64)
    q_len = (tl.load(cu_seqlens_ptr + seq + 1) - q_start).to(tl.int32)
    if tile * BLOCK_T >= q_len:
        return
    ctx = tl.load(context_lens_ptr + seq).to(tl.int32)

    r = tl.arange(0, BLOCK_T * GROUP_P)  # [M] rows: (query, head of the group), query-major
    t = tile * BLOCK_T + r // GROUP_P  # query index within the sequence
    g = r % GROUP_P
    row_ok = (t < q_len) & (g < GROUP)
    q_pos = ctx - q_len + t  # [M] absolute positions
    d = tl.arange(0, HEAD_DIM)
    q_rows = (q_start + t)[:, None] * stride_qt + (kv_head * GROUP + g)[:, None] * stride_qh
    q = tl.load(q_ptr + q_rows + d[None, :] * stride_qd, mask=row_ok[:, None], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)

    # Blocks [lo, hi) hold every key some row can see; [full_lo, full_hi) every row sees whole.
    first_pos = ctx - q_len + tile * BLOCK_T
    last_pos = ctx - q_len + tl.minimum((tile + 1) * BLOCK_T, q_len) - 1
    hi = last_pos // BLOCK_SIZE + 1
    lo = 0
    full_lo = 0
    if USE_WINDOW:
        lo = tl.maximum(first_pos - window + 1, 0) // BLOCK_SIZE
        full_lo = (tl.maximum(last_pos - window + 1, 0) + BLOCK_SIZE - 1) // BLOCK_SIZE
    full_hi = (first_pos + 1) // BLOCK_SIZE
    # masked [lo, mid_lo), whole [mid_lo, mid_hi), masked [mid_hi, hi)
    mid_lo = tl.minimum(full_lo, hi)
    mid_hi = tl.maximum(full_hi, mid_lo)

    m_i = tl.full([BLOCK_T * GROUP_P], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_T * GROUP_P], tl.float32)
    acc = tl.zeros([BLOCK_T * GROUP_P, HEAD_DIM], tl.float32)
    offs_b = tl.arange(0, BLOCK_SIZE)
    # [B, D] pointers into block 0's K of this kv head; a block's K is block_id * stride_cn on.
    head_base = (
        cache_ptr + kv_head * stride_ch + offs_b[:, None] * stride_cb + d[None, :] * stride_cd
    )
    table = block_tables_ptr + seq * stride_bts
    for j in range(lo, mid_lo):
        block = tl.load(table + j * stride_btb).to(tl.int64)
        k_pos = j * BLOCK_SIZE + offs_b
        visible = (k_pos[None, :] <= q_pos[:, None]) & (k_pos[None, :] > q_pos[:, None] - window)
        k, v = _load_kv(head_base + block * stride_cn, stride_ckv, k_pos < ctx, k_scale, v_scale,
                        q.dtype, True, FP8, UPCAST)  # fmt: skip
        acc, m_i, l_i = _softmax_step(q, k, v, acc, m_i, l_i, visible, qk_scale, True)
    for j in range(mid_lo, mid_hi):
        block = tl.load(table + j * stride_btb).to(tl.int64)
        k, v = _load_kv(head_base + block * stride_cn, stride_ckv, offs_b, k_scale, v_scale,
                        q.dtype, False, FP8, UPCAST)  # fmt: skip
        acc, m_i, l_i = _softmax_step(q, k, v, acc, m_i, l_i, 0, qk_scale, False)
    for j in range(mid_hi, hi):
        block = tl.load(table + j * stride_btb).to(tl.int64)
        k_pos = j * BLOCK_SIZE + offs_b
        visible = k_pos[None, :] <= q_pos[:, None]
        if USE_WINDOW:
            visible = visible & (k_pos[None, :] > q_pos[:, None] - window)
        k, v = _load_kv(head_base + block * stride_cn, stride_ckv, k_pos < ctx, k_scale, v_scale,
                        q.dtype, True, FP8, UPCAST)  # fmt: skip
        acc, m_i, l_i = _softmax_step(q, k, v, acc, m_i, l_i, visible, qk_scale, True)

    # Padding rows may have seen nothing; they are not stored.
    l_i = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc / l_i[:, None]
    o_rows = (q_start + t)[:, None] * stride_ot + (kv_head * GROUP + g)[:, None] * stride_oh
    tl.store(out_ptr + o_rows + d[None, :] * stride_od, out.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None])  # fmt: skip


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
    max_q_len: int | None = None,
    config: PrefillConfig | None = None,
) -> None:
    group, num_kv_heads, block_size, head_dim = _check_attention(q, layer_cache, sliding_window)
    assert out.shape == q.shape, f"out must be shaped like q {tuple(q.shape)}: {tuple(out.shape)}"
    num_seqs = context_lens.shape[0]
    if num_seqs == 0 or q.shape[0] == 0:
        return
    q = q.to(compute_dtype(q, layer_cache))
    cu_seqlens_q = cu_seqlens_q.contiguous()
    context_lens = context_lens.contiguous()
    # The grid needs the longest query run: from the caller, who has it on the host, else
    # one device-to-host sync (which stalls the GPU's queue in every layer).
    if max_q_len is None:
        max_q_len = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max())
    if max_q_len == 0:
        return
    config = config or default_config(max_q_len, group)
    group_p = triton.next_power_of_2(group)
    block_t = max(1, config.rows // group_p)
    grid = (triton.cdiv(max_q_len, block_t), num_seqs, num_kv_heads)
    with _device_guard(q):
        _prefill_gqa_kernel[grid](
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
            GROUP_P=group_p,
            USE_WINDOW=sliding_window is not None,
            BLOCK_T=block_t,
            BLOCK_SIZE=block_size,
            HEAD_DIM=head_dim,
            FP8=is_fp8(layer_cache.dtype),
            UPCAST=_INTERPRETED,
            num_warps=config.num_warps,
            num_stages=config.num_stages,
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
    max_q_len: int | None = None,  # the longest query run, if the caller knows it (no sync)
) -> torch.Tensor:  # [T, H_q, D]
    out = torch.empty_like(q)
    _prefill_into(
        out, q, layer_cache, cu_seqlens_q, context_lens, block_tables, scale, sliding_window,
        k_scale, v_scale, max_q_len,
    )  # fmt: skip
    return out
