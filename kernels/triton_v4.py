"""DeepSeek-V4's paged ops as Triton kernels, with the signatures and semantics of
kernels/v4_reference.py (chosen per call by kernels/v4_ops.py).

* ``write_rows``: one program a token copies its row into its slot (negative: skipped).
* ``compress``: one program a closing window walks its 2m (m) rows, an online softmax per
  channel over ``gate + ape``, the pooled values normed (RMSNorm weight) in float32. An fp8
  cache's compressor state is unquantized after the K=V record: read in place as the
  model's dtype (the row's bytes viewed so), not copied.
* ``sink_attention``: one program a (query, block of heads) walks the query's window slots
  then its entry slots, BLOCK_N keys a tile, an online softmax (base 2) whose running max
  and sum start at the head's sink logit (so the sink sits in the denominator and gives
  no value), float32 accumulation. An fp8 cache's K=V records (kernels/fp8_ds_v4.py:
  fp8 nope values, a ue8m0 scale byte a 64-value tile, the rope values in bf16) are
  dequantized inside the kernel as each tile is loaded.

Under Triton's interpreter (``TRITON_INTERPRET=1``) the dots run in float32 (the
interpreter has no bfloat16 arithmetic, as kernels/triton_common.py notes).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from pdserve.kernels import fp8_ds_v4
from pdserve.kernels.v4_reference import Fp8Rows

_LOG2E = 1.4426950408889634
_INTERPRET = os.environ.get("TRITON_INTERPRET", "").strip().lower() in ("1", "true", "on")
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_TL = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


def _pow2(n: int) -> bool:
    return n >= 16 and n & (n - 1) == 0


def unsupported(op: str, *tensors: torch.Tensor, fp8: Fp8Rows | None = None) -> str | None:
    """Why ``op`` cannot run as a Triton kernel on these arguments; None if it can."""
    if op == "write_rows":
        return None
    if op == "compress":
        _cache, ape, _weight = tensors
        if ape.dtype not in _DTYPES:
            return f"compress: a model of {ape.dtype}"
        return None
    if op == "sink_attention":
        q, _rows = tensors
        if q.dtype not in _DTYPES:
            return f"sink_attention: queries of {q.dtype}"
        if not _pow2(q.shape[-1]):
            return f"sink_attention: head_dim {q.shape[-1]} (powers of two >= 16)"
        return None
    return f"{op}: no Triton kernel"


# -- row writes -------------------------------------------------------------------------


@triton.jit
def _write_rows_kernel(
    src_ptr, cache_ptr, slots_ptr, src_st, c_sb, c_so, width, B, BLOCK: tl.constexpr
):
    t = tl.program_id(0)
    slot = tl.load(slots_ptr + t)
    if slot >= 0:
        dst = cache_ptr + (slot // B) * c_sb + (slot % B) * c_so
        for c0 in range(0, width, BLOCK):
            cols = c0 + tl.arange(0, BLOCK)
            mask = cols < width
            tl.store(dst + cols, tl.load(src_ptr + t * src_st + cols, mask=mask), mask=mask)


def write_rows(cache: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor) -> None:
    num = rows.shape[0]
    if num == 0:
        return
    rows = rows.to(cache.dtype).contiguous()
    assert cache.stride(-1) == 1
    width = rows.shape[-1]
    _write_rows_kernel[(num,)](
        rows, cache, slots.long().contiguous(), rows.stride(0), cache.stride(0),
        cache.stride(3), width, cache.shape[3], BLOCK=min(1024, triton.next_power_of_2(width)),
    )  # fmt: skip


# -- window close + compression -----------------------------------------------------------


@triton.jit
def _load_vals(row, col, mask, NB: tl.constexpr, SDT: tl.constexpr):
    # values col of a row, in float32: NB 0, the row's own dtype; else values of NB bytes
    # (SDT) put together from an fp8 cache's bytes (at any byte alignment)
    if NB == 0:
        return tl.load(row + col, mask=mask, other=0.0).to(tl.float32)
    else:
        at = row + col * NB
        bits = tl.load(at, mask=mask, other=0).to(tl.uint32)
        for i in tl.static_range(1, NB):
            bits = bits | (tl.load(at + i, mask=mask, other=0).to(tl.uint32) << (8 * i))
        if NB == 4:
            return bits.to(tl.float32, bitcast=True)
        else:
            return bits.to(tl.uint16).to(SDT, bitcast=True).to(tl.float32)


@triton.jit
def _compress_kernel(
    cache_ptr, slots_ptr, ape_ptr, w_ptr, out_ptr, cos_ptr, sin_ptr,
    c_sb, c_so, B, L, M, offset, width, eps, d, R, cs_st,
    OVERLAP: tl.constexpr, BLOCK_D: tl.constexpr, NB: tl.constexpr, SDT: tl.constexpr,
    ROPE: tl.constexpr,
):  # fmt: skip
    p = tl.program_id(0)
    c = tl.arange(0, BLOCK_D)
    cmask = c < d
    run_max = tl.full([BLOCK_D], -1e30, tl.float32)
    run_sum = tl.zeros([BLOCK_D], tl.float32)
    acc = tl.zeros([BLOCK_D], tl.float32)
    for j in range(0, L):
        slot = tl.load(slots_ptr + p * L + j)
        if slot >= 0:
            row = cache_ptr + (slot // B) * c_sb + (slot % B) * c_so + offset
            if OVERLAP:  # j < m: the previous window's first series; else this one's second
                second = j >= M
                col = c + tl.where(second, d, 0)
                ape_row = tl.where(second, j - M, j)
            else:
                col = c
                ape_row = j
            kv = _load_vals(row, col, cmask, NB, SDT)
            gate = _load_vals(row, width + col, cmask, NB, SDT)
            gate += tl.load(ape_ptr + ape_row * width + col, mask=cmask, other=0.0).to(tl.float32)
            new_max = tl.maximum(run_max, gate)
            alpha = tl.exp(run_max - new_max)
            e = tl.exp(gate - new_max)
            run_sum = run_sum * alpha + e
            acc = acc * alpha + e * kv
            run_max = new_max
    pooled = tl.where(cmask, acc / run_sum, 0.0)
    inv = 1.0 / tl.sqrt(tl.sum(pooled * pooled, 0) / d + eps)
    w = tl.load(w_ptr + c, mask=cmask, other=0.0).to(tl.float32)
    tl.store(out_ptr + p * d + c, (w * (pooled * inv)).to(out_ptr.dtype.element_ty), mask=cmask)
    if ROPE:  # the entry rotated at its window's first position, as v4_ops.rope_ref
        tl.debug_barrier()  # the row stored above, seen by every thread of the program
        first = d - R
        is_rope = cmask & (c >= first)
        rel = tl.where(is_rope, c - first, 0)
        x = tl.load(out_ptr + p * d + c, mask=is_rope, other=0.0).to(tl.float32)
        px = tl.load(out_ptr + p * d + (c ^ 1), mask=is_rope, other=0.0).to(tl.float32)
        cs = tl.load(cos_ptr + p * cs_st + rel // 2, mask=is_rope, other=0.0).to(tl.float32)
        sn = tl.load(sin_ptr + p * cs_st + rel // 2, mask=is_rope, other=0.0).to(tl.float32)
        rot = x * cs + tl.where((rel % 2) == 1, px, -px) * sn
        tl.debug_barrier()  # every partner read before any is overwritten
        tl.store(out_ptr + p * d + c, rot.to(out_ptr.dtype.element_ty), mask=is_rope)


def compress(
    cache: torch.Tensor,
    slots: torch.Tensor,
    offset: int,
    ape: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    overlap: bool,
    dtype: torch.dtype,
    fp8: Fp8Rows | None = None,
    cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    m, width = ape.shape
    d = weight.shape[0]
    num, span = slots.shape
    out = torch.empty(num, d, dtype=dtype, device=cache.device)
    if num == 0:
        return out
    nb = 0
    if fp8 is not None:  # the state in the model's dtype after the K=V record, read in place
        nb = torch.finfo(dtype).bits // 8
        offset = fp8_ds_v4.kv_bytes(fp8.head_dim, fp8.rope_dim) + (offset - fp8.head_dim) * nb
    cos, sin = cos_sin if cos_sin is not None else (out, out)
    cos, sin = cos.contiguous(), sin.contiguous()
    _compress_kernel[(num,)](
        cache, slots.long().contiguous(), ape.contiguous(), weight.contiguous(), out, cos, sin,
        cache.stride(0), cache.stride(3), cache.shape[3], span, m, offset, width, eps, d,
        2 * cos.shape[-1] if cos_sin is not None else 0, cos.stride(0),
        OVERLAP=overlap, BLOCK_D=triton.next_power_of_2(d), NB=nb,
        SDT=_TL.get(dtype, tl.float32), ROPE=cos_sin is not None,
    )  # fmt: skip
    return out


# -- attention over window rows + entries, with sinks --------------------------------------


@triton.jit
def _load_kv(
    base, d_idx, valid, D: tl.constexpr, FP8: tl.constexpr, NOPE: tl.constexpr,
    ROPE: tl.constexpr, DTYPE: tl.constexpr,
):  # fmt: skip
    # base [N] row pointers; the tile [N, D] of the K=V values, in DTYPE
    if FP8:
        is_nope = d_idx < NOPE
        byte = tl.load(base[:, None] + d_idx[None, :], mask=valid[:, None] & is_nope[None, :],
                       other=0)  # fmt: skip
        nope = byte.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        scale_at = NOPE + 2 * ROPE + d_idx // 64
        sbyte = tl.load(base[:, None] + scale_at[None, :], mask=valid[:, None] & is_nope[None, :],
                        other=127)  # fmt: skip
        scale = tl.exp2(sbyte.to(tl.float32) - 127.0)
        r = tl.where(is_nope, 0, d_idx - NOPE)
        rope_mask = valid[:, None] & (~is_nope)[None, :]
        lo = tl.load(base[:, None] + (NOPE + 2 * r)[None, :], mask=rope_mask, other=0)
        hi = tl.load(base[:, None] + (NOPE + 2 * r + 1)[None, :], mask=rope_mask, other=0)
        bits = (lo.to(tl.uint16) | (hi.to(tl.uint16) << 8)).to(tl.bfloat16, bitcast=True)
        vals = tl.where(is_nope[None, :], nope * scale, bits.to(tl.float32))
        return vals.to(DTYPE)
    else:
        return tl.load(base[:, None] + d_idx[None, :], mask=valid[:, None], other=0.0).to(DTYPE)


@triton.jit
def _attend_tile(
    q, kv, valid, acc, m_i, l_i, qk_scale, DTYPE: tl.constexpr, IEEE: tl.constexpr
):  # fmt: skip
    if IEEE:
        s = tl.dot(q, tl.trans(kv), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(kv))
    s = s * qk_scale
    s = tl.where(valid[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if IEEE:
        pv = tl.dot(p.to(DTYPE), kv, input_precision="ieee")
    else:
        pv = tl.dot(p.to(DTYPE), kv)
    acc = acc * alpha[:, None] + pv
    return acc, m_new, l_i


@triton.jit
def _sink_attention_kernel(
    q_ptr, rows_ptr, win_ptr, entries_ptr, ent_ptr, sinks_ptr, out_ptr,
    q_st, q_sh, o_st, o_sh, r_sb, r_so, e_sb, e_so, win_st, ent_st,
    H, W, E, RB, EB, qk_scale,
    D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    FP8: tl.constexpr, NOPE: tl.constexpr, ROPE: tl.constexpr,
    DTYPE: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = heads < H
    d_idx = tl.arange(0, D)
    q = tl.load(q_ptr + t * q_st + heads[:, None] * q_sh + d_idx[None, :], mask=hmask[:, None],
                other=0.0).to(DTYPE)  # fmt: skip
    # the sink: a logit that takes softmax mass and gives no value (base 2)
    m_i = tl.load(sinks_ptr + heads, mask=hmask, other=0.0).to(tl.float32) * 1.4426950408889634
    l_i = tl.full([BLOCK_H], 1.0, tl.float32)
    acc = tl.zeros([BLOCK_H, D], tl.float32)
    for n0 in range(0, W, BLOCK_N):
        offs = n0 + tl.arange(0, BLOCK_N)
        slot = tl.load(win_ptr + t * win_st + offs, mask=offs < W, other=-1)
        valid = slot >= 0
        s = tl.maximum(slot, 0)
        base = rows_ptr + (s // RB) * r_sb + (s % RB) * r_so
        kv = _load_kv(base, d_idx, valid, D, FP8, NOPE, ROPE, DTYPE)
        acc, m_i, l_i = _attend_tile(q, kv, valid, acc, m_i, l_i, qk_scale, DTYPE, IEEE)
    for n0 in range(0, E, BLOCK_N):
        offs = n0 + tl.arange(0, BLOCK_N)
        slot = tl.load(ent_ptr + t * ent_st + offs, mask=offs < E, other=-1)
        valid = slot >= 0
        s = tl.maximum(slot, 0)
        base = entries_ptr + (s // EB) * e_sb + (s % EB) * e_so
        kv = _load_kv(base, d_idx, valid, D, FP8, NOPE, ROPE, DTYPE)
        acc, m_i, l_i = _attend_tile(q, kv, valid, acc, m_i, l_i, qk_scale, DTYPE, IEEE)
    out = acc / l_i[:, None]
    tl.store(out_ptr + t * o_st + heads[:, None] * o_sh + d_idx[None, :],
             out.to(out_ptr.dtype.element_ty), mask=hmask[:, None])  # fmt: skip


def sink_attention(
    q: torch.Tensor,
    rows_cache: torch.Tensor,
    window_slots: torch.Tensor,
    entries_cache: torch.Tensor | None,
    entry_slots: torch.Tensor | None,
    sinks: torch.Tensor,
    scale: float,
    fp8: Fp8Rows | None = None,
) -> torch.Tensor:
    num, heads, d = q.shape
    out = torch.empty_like(q)
    if num == 0:
        return out
    if q.stride(-1) != 1:
        q = q.contiguous()
    window_slots = window_slots.long().contiguous()
    if entries_cache is None or entry_slots is None or entry_slots.shape[1] == 0:
        entries_cache, entry_slots = rows_cache, window_slots[:, :0]
    entry_slots = entry_slots.long().contiguous()
    dtype = torch.float32 if _INTERPRET else q.dtype
    block_h = 16
    _sink_attention_kernel[(num, triton.cdiv(heads, block_h))](
        q, rows_cache, window_slots, entries_cache, entry_slots, sinks.float().contiguous(), out,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        rows_cache.stride(0), rows_cache.stride(3), entries_cache.stride(0), entries_cache.stride(3),
        window_slots.stride(0), max(entry_slots.stride(0), 1),
        heads, window_slots.shape[1], entry_slots.shape[1], rows_cache.shape[3],
        entries_cache.shape[3], scale * _LOG2E,
        D=d, BLOCK_H=block_h, BLOCK_N=16, FP8=fp8 is not None,
        NOPE=(fp8.head_dim - fp8.rope_dim) if fp8 else 0, ROPE=fp8.rope_dim if fp8 else 0,
        DTYPE=_TL[dtype], IEEE=dtype == torch.float32,
    )  # fmt: skip
    return out
