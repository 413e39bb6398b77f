"""DeepSeek-V3.2's sparse MLA in Triton, with kernels/sparse_mla_ref.py's signature and
semantics: absorbed queries attend only the rows their indexer selected.

One program per (query, block of ``BLOCK_H`` heads): it walks the query's ``topk`` indices
``BLOCK_N`` at a time, finds each selected row through the block table, loads its latent and
rope parts (fp8 rows: the fp8_ds_mla record dequantized in the kernel, kernels/
triton_mla_fp8.py ``load_ds_mla``: fp8 latent times its tile's scale, bf16 rope), and runs
an online softmax (base 2) in float32, dots in float32 (``ieee``). Indices ``-1`` are
skipped; a query with none gets zeros. Nothing is read back to the host: a CUDA graph can
capture it.

Constraints: latent and rope widths powers of two (fp8: latent a multiple of 128).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.kernels import fp8_ds_mla
from pdserve.kernels.sparse_mla_ref import check_args
from pdserve.kernels.triton_common import _device_guard, _is_pow2
from pdserve.kernels.triton_mla_fp8 import load_ds_mla

_LOG2E = 1.4426950408889634
BLOCK_N = 16  # selected rows per step


@triton.jit
def _sparse_mla_kernel(
    q_ptr,  # [T, H, LATENT + ROPE]
    cache_ptr,  # [N, B, row]
    tables_ptr,  # [S, max_blocks] int32
    seq_ptr,  # [T] int32
    idx_ptr,  # [T, topk] int32
    out_ptr,  # [T, H, LATENT]
    stride_qt,
    stride_qh,
    stride_qd,
    stride_cn,
    stride_cb,
    stride_ts,
    stride_it,
    stride_ot,
    stride_oh,
    num_heads,
    topk,
    qk_scale,  # scale * log2(e)
    LATENT: tl.constexpr,
    ROPE: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    FP8: tl.constexpr,
    TILE: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = h < num_heads
    dl = tl.arange(0, LATENT)
    dr = tl.arange(0, ROPE)
    q_row = q_ptr + t * stride_qt + h[:, None] * stride_qh
    q_lat = tl.load(q_row + dl[None, :] * stride_qd, mask=h_ok[:, None], other=0.0)
    q_rope = tl.load(q_row + (LATENT + dr)[None, :] * stride_qd, mask=h_ok[:, None], other=0.0)
    q_lat = q_lat.to(tl.float32)
    q_rope = q_rope.to(tl.float32)
    seq = tl.load(seq_ptr + t).to(tl.int64)
    m_i = tl.full((BLOCK_H,), -1e30, dtype=tl.float32)
    l_i = tl.zeros((BLOCK_H,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_H, LATENT), dtype=tl.float32)
    for n0 in range(0, topk, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        idx = tl.load(idx_ptr + t * stride_it + n, mask=n < topk, other=-1)
        ok = idx >= 0
        pos = tl.maximum(idx, 0).to(tl.int64)
        blk = tl.load(tables_ptr + seq * stride_ts + pos // BLOCK_SIZE, mask=ok, other=0)
        rows = cache_ptr + blk.to(tl.int64) * stride_cn + (pos % BLOCK_SIZE) * stride_cb
        if FP8:
            lat, rope = load_ds_mla(rows, ok, LATENT, ROPE, TILE, tl.float32)
        else:
            lat = tl.load(rows[:, None] + dl[None, :], mask=ok[:, None], other=0.0)
            rope = tl.load(rows[:, None] + (LATENT + dr)[None, :], mask=ok[:, None], other=0.0)
            lat = lat.to(tl.float32)
            rope = rope.to(tl.float32)
        s = tl.dot(q_lat, tl.trans(lat), input_precision="ieee")
        s += tl.dot(q_rope, tl.trans(rope), input_precision="ieee")
        s = tl.where(ok[None, :], s * qk_scale, float("-inf"))  # [BLOCK_H, BLOCK_N]
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p, lat, input_precision="ieee")
        m_i = m_new
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    o_ptrs = out_ptr + t * stride_ot + h[:, None] * stride_oh + dl[None, :]
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=h_ok[:, None])


@triton.jit
def _write_rows_kernel(
    cache_ptr,  # [N, B, row]
    rows_ptr,  # [T, row], the cache's dtype
    slot_ptr,  # [T] int64; negative: padding, skipped
    stride_cn,
    stride_cb,
    stride_rt,
    width,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:
        dst = cache_ptr + (slot // BLOCK_SIZE) * stride_cn + (slot % BLOCK_SIZE) * stride_cb
        for d0 in range(0, width, BLOCK_D):
            d = d0 + tl.arange(0, BLOCK_D)
            tl.store(dst + d, tl.load(rows_ptr + t * stride_rt + d, mask=d < width), mask=d < width)


def write_rows(
    cache: torch.Tensor,  # [N, B, row]
    rows: torch.Tensor,  # [T, row]
    slot_mapping: torch.Tensor,  # [T] int64, block_id * B + offset; negative: skipped
) -> None:
    assert cache.stride(-1) == 1 and rows.shape[1] == cache.shape[2], (
        f"rows {tuple(rows.shape)} for a cache of {tuple(cache.shape)}"
    )
    if rows.shape[0] == 0:
        return
    rows = rows.to(cache.dtype).contiguous()
    with _device_guard(cache):
        _write_rows_kernel[(rows.shape[0],)](
            cache,
            rows,
            slot_mapping.contiguous(),
            cache.stride(0),
            cache.stride(1),
            rows.stride(0),
            rows.shape[1],
            BLOCK_SIZE=cache.shape[1],
            BLOCK_D=min(1024, triton.next_power_of_2(rows.shape[1])),
        )


def sparse_mla_attention(
    q: torch.Tensor,  # [T, H, latent + rope]
    cache: torch.Tensor,  # [N, B, row]
    latent_dim: int,
    block_tables: torch.Tensor,  # [S, max_blocks] int32
    query_seq: torch.Tensor,  # [T] int32
    indices: torch.Tensor,  # [T, topk] int32
    scale: float,
) -> torch.Tensor:  # [T, H, latent]
    rope = check_args(q, cache, latent_dim, block_tables, query_seq, indices)
    num_tokens, num_heads, _ = q.shape
    assert _is_pow2(latent_dim) and _is_pow2(rope) and rope >= 16, (
        f"the sparse MLA kernel needs power-of-two latent and rope (>= 16): {latent_dim}, {rope}"
    )
    fp8 = cache.dtype == torch.uint8
    if fp8:
        fp8_ds_mla.check_rank(latent_dim)
    assert cache.stride(-1) == 1, "the cache's rows must be contiguous"
    out = torch.empty((num_tokens, num_heads, latent_dim), dtype=q.dtype, device=q.device)
    if num_tokens == 0:
        return out
    tables = block_tables if block_tables.dtype == torch.int32 else block_tables.int()
    indices = indices.int().contiguous()
    block_h = 16 if latent_dim > 128 else max(16, min(64, triton.next_power_of_2(num_heads)))
    with _device_guard(q):
        _sparse_mla_kernel[(num_tokens, triton.cdiv(num_heads, block_h))](
            q,
            cache,
            tables,
            query_seq.int().contiguous(),
            indices,
            out,
            *q.stride(),
            cache.stride(0),
            cache.stride(1),
            tables.stride(0),
            indices.stride(0),
            out.stride(0),
            out.stride(1),
            num_heads,
            indices.shape[1],
            scale * _LOG2E,
            LATENT=latent_dim,
            ROPE=rope,
            BLOCK_SIZE=cache.shape[1],
            BLOCK_H=block_h,
            BLOCK_N=BLOCK_N,
            FP8=fp8,
            TILE=fp8_ds_mla.TILE,
        )
    return out
