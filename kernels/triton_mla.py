"""Triton kernels for an MLA latent cache, with the signatures of kernels/mla_reference.py.

One layer's cache is the strided view ``[N, 1, 1, B, D]``, D = LATENT + ROPE: per token the
latent (kv_lora_rank values) then the rotated rope key. The absorbed decode attends it
as multi-query attention: query head h's row ``q[s, h]`` (D values: q_nope through W_UK,
then q_rope) scores ``q . row`` against every cached row, and the output is the softmax
over those scores applied to the rows' latent parts (LATENT values).

``_mla_decode_kernel``: one program per (sequence, BLOCK_H query heads, split). The heads
of the tile are the rows of ``tl.dot``, so each latent row is read once per BLOCK_H heads
(DeepSeek-V3: 128 heads, 8 reads per step at BLOCK_H = 16, against 128 for per-head K/V).
The head tiles are the grid's fastest axis, then the splits, then the sequences: the 8
programs that read the same rows are launched side by side and run together, so the rows
come from memory once and from L2 the other 7 times. (With the sequence fastest, as
before, a batch of 64 ran the programs of one head tile for every sequence at once, and
read every latent row from memory 8 times: at DeepSeek-V3's shape, context 2048, 287 us a
layer on the H200 where its 151 MB take 31.)
Scores in fp32, online softmax in base 2 (``scale * log2(e)`` folded in), accumulated in
fp32. With SPLITS > 1 the sequence's blocks are cut into SPLITS equal runs (flash
decoding), each run's partial softmax merged by ``triton_common.reduce_splits`` in split
order (with DeepSeek-V4's per-head sinks, optionally); the
cut depends on the context length and SPLITS only, so an eager step and a CUDA-graph replay
that pass the same ``num_splits`` agree bit for bit.

fp8 caches (``--kv-cache-dtype fp8``): uint8, each token one fp8_ds_mla record (fp8 latent,
one fp32 scale per 128 values, bf16 rope; kernels/triton_mla_fp8.py). The write quantizes
each row into its record; the decode kernel (DS_MLA) loads each key tile's records once
(their scales as one [BLOCK_N, LATENT / 128] load), dequantizes the tile into q's dtype
(bf16 for a bf16 model) and uses it for both the score and the value dot; q then is not
cast to the cache's dtype. Tile sizes and warps: ``decode_launch``.

Constraints: LATENT and ROPE powers of two >= 16 (DeepSeek: 512 and 64), block_size a
power of two >= 16. Under Triton's interpreter (``TRITON_INTERPRET=1``) operands are
upcast to fp32 (the interpreter has no bfloat16 arithmetic).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.kernels import fp8_ds_mla
from pdserve.kernels.triton_common import (
    _LOG2E,
    _device_guard,
    _is_pow2,
    check_sinks,
    decode_splits_for,
    finish_rows,
    reduce_splits,
    store_partials,
)
from pdserve.kernels.triton_mla_fp8 import load_ds_mla, record_rope, write_ds_mla

BLOCK_H = 16  # query heads per program: the rows of tl.dot (>= 16)


def untileable_sizes(latent_dim: int, rope_dim: int) -> dict[str, int]:
    """The MLA sizes these kernels cannot tile (``tl.arange`` spans: powers of two >= 16),
    by their config names; empty when both are fine."""
    sizes = {"kv_lora_rank": latent_dim, "qk_rope_head_dim": rope_dim}
    return {name: n for name, n in sizes.items() if not (_is_pow2(n) and n >= 16)}


@triton.jit
def _write_latent_kernel(
    cache_ptr,  # [N, 1, 1, B, D]
    row_ptr,  # [T, D] in the cache dtype
    slot_ptr,  # [T]
    stride_cn,
    stride_cb,
    stride_cd,
    stride_rt,
    stride_rd,
    D,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # One program per token: copies one latent row; negative slots (padding) are skipped.
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t)
    if slot >= 0:
        d = tl.arange(0, BLOCK_D)
        ok = d < D
        row = tl.load(row_ptr + t * stride_rt + d * stride_rd, mask=ok)
        dst = cache_ptr + (slot // BLOCK_SIZE) * stride_cn + (slot % BLOCK_SIZE) * stride_cb
        tl.store(dst + d * stride_cd, row, mask=ok)


@triton.jit
def _mla_decode_kernel(
    out_ptr,  # [S, H, LATENT], written when SPLITS == 1
    q_ptr,  # [S, H, LATENT + ROPE] in the cache dtype
    cache_ptr,  # [N, 1, 1, B, LATENT + ROPE]
    context_lens_ptr,  # [S]
    block_tables_ptr,  # [S, max_blocks]
    part_acc_ptr,  # [S, H, SPLITS, LATENT] fp32
    part_ml_ptr,  # [S, H, SPLITS, 2] fp32
    sinks_ptr,  # [H] fp32 per-head sink logits (read when HAS_SINK and SPLITS == 1)
    qk_scale,  # scale * log2(e)
    num_heads,
    stride_qs,
    stride_qh,
    stride_qd,
    stride_os,
    stride_oh,
    stride_od,
    stride_cn,
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
    LATENT: tl.constexpr,
    ROPE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,  # keys per tile, dividing BLOCK_SIZE
    SPLITS: tl.constexpr,
    UPCAST: tl.constexpr,
    DS_MLA: tl.constexpr,  # uint8 cache of fp8_ds_mla records (stride_cd is 1: bytes)
    TILE: tl.constexpr,  # DS_MLA: latent values per scale
    HAS_SINK: tl.constexpr,
):
    # grid (head tiles, splits, sequences): the tiles reading the same rows side by side
    heads = tl.program_id(0).to(tl.int64) * BLOCK_H + tl.arange(0, BLOCK_H)  # [H_t]
    h_ok = heads < num_heads
    split = tl.program_id(1)
    seq = tl.program_id(2).to(tl.int64)
    ctx = tl.load(context_lens_ptr + seq).to(tl.int32)

    dl = tl.arange(0, LATENT)
    dr = tl.arange(0, ROPE)
    q_row = q_ptr + seq * stride_qs + heads[:, None] * stride_qh
    q_lat = tl.load(q_row + dl[None, :] * stride_qd, mask=h_ok[:, None], other=0.0)  # [H_t, L]
    q_rope = tl.load(q_row + (LATENT + dr)[None, :] * stride_qd, mask=h_ok[:, None], other=0.0)
    if UPCAST:
        q_lat = q_lat.to(tl.float32)
        q_rope = q_rope.to(tl.float32)

    hi = tl.cdiv(ctx, BLOCK_SIZE)
    lo = 0
    if SPLITS > 1:
        per_split = tl.cdiv(hi, SPLITS)
        lo = split * per_split
        hi = tl.minimum(hi, lo + per_split)

    m_i = tl.full([BLOCK_H], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, LATENT], tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    table = block_tables_ptr + seq * stride_bts
    for j in range(lo, hi):
        block_id = tl.load(table + j * stride_btb).to(tl.int64)
        block_base = cache_ptr + block_id * stride_cn
        for sub in tl.static_range(BLOCK_SIZE // BLOCK_N):
            offs = sub * BLOCK_N + offs_n  # [N] offsets in the block
            k_ok = j * BLOCK_SIZE + offs < ctx
            rows = block_base + offs[:, None] * stride_cb
            if DS_MLA:  # dequantized once into q's dtype, used by both dots
                c, r = load_ds_mla(block_base + offs * stride_cb, k_ok, LATENT, ROPE, TILE,
                                   q_lat.dtype)  # fmt: skip
            else:
                c = tl.load(rows + dl[None, :] * stride_cd, mask=k_ok[:, None], other=0.0)
                r = tl.load(
                    rows + (LATENT + dr)[None, :] * stride_cd, mask=k_ok[:, None], other=0.0
                )  # c: [N, L], r: [N, R]
            if UPCAST:
                c = c.to(tl.float32)
                r = r.to(tl.float32)
            # ieee: float32 tiles would otherwise multiply in TF32 (10-bit mantissa), enough to flip
            # a random model's near-tied argmax against transformers' float32
            s = tl.dot(q_lat, tl.trans(c), input_precision="ieee")
            s += tl.dot(q_rope, tl.trans(r), input_precision="ieee")  # [H_t, N] fp32
            visible = k_ok[None, :] & h_ok[:, None]
            s = tl.where(visible, s * qk_scale, -1.0e30)
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.where(visible, tl.exp2(s - m_new[:, None]), 0.0)
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(c.dtype), c, input_precision="ieee")
            m_i = m_new

    if SPLITS > 1:
        store_partials(part_acc_ptr, part_ml_ptr, seq, heads, split, dl, acc, m_i, l_i, h_ok,
                       stride_as, stride_ah, stride_ap, stride_ms, stride_mh, stride_mp)  # fmt: skip
    else:
        sink = m_i
        if HAS_SINK:
            sink = tl.load(sinks_ptr + heads, mask=h_ok, other=0.0) * 1.4426950408889634
        out = finish_rows(acc, m_i, l_i, sink, HAS_SINK)
        o_ptrs = out_ptr + seq * stride_os + heads[:, None] * stride_oh + dl[None, :] * stride_od
        tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=h_ok[:, None])


# True when TRITON_INTERPRET was set as this module was imported.
_INTERPRETED = not isinstance(_mla_decode_kernel, triton.runtime.JITFunction)


def _check_cache(layer_cache: torch.Tensor) -> tuple[int, int]:
    """(block_size, D) of a ``[N, 1, 1, B, D]`` latent layer view, checked."""
    assert layer_cache.dim() == 5 and layer_cache.shape[1:3] == (1, 1), (
        f"an MLA layer cache is [N, 1, 1, block_size, D], got {tuple(layer_cache.shape)}"
    )
    block_size = layer_cache.shape[3]
    assert _is_pow2(block_size) and block_size >= 16, (
        f"triton kernels need block_size to be a power of two >= 16, got {block_size}"
    )
    return block_size, layer_cache.shape[4]


def write_latent(
    layer_cache: torch.Tensor,  # [N, 1, 1, B, D]
    latent: torch.Tensor,  # [T, D]
    slot_mapping: torch.Tensor,  # [T] int64; negative: padding, skipped
    latent_dim: int | None = None,  # kv_lora_rank: needed by fp8_ds_mla (uint8) caches
) -> None:
    block_size, width = _check_cache(layer_cache)
    if fp8_ds_mla.is_ds_mla(layer_cache.dtype):
        assert latent_dim is not None, "an fp8_ds_mla cache (uint8) needs latent_dim"
        write_ds_mla(layer_cache, latent, slot_mapping, latent_dim, block_size)
        return
    assert latent.dim() == 2 and latent.shape[1] == width, (
        f"latent rows must be [T, {width}], got {tuple(latent.shape)}"
    )
    if latent.shape[0] == 0:
        return
    latent = latent.to(layer_cache.dtype)
    slot_mapping = slot_mapping.contiguous()
    stride_cn, _, _, stride_cb, stride_cd = layer_cache.stride()
    with _device_guard(layer_cache):
        _write_latent_kernel[(latent.shape[0],)](
            layer_cache,
            latent,
            slot_mapping,
            stride_cn,
            stride_cb,
            stride_cd,
            *latent.stride(),
            width,
            BLOCK_SIZE=block_size,
            BLOCK_D=triton.next_power_of_2(width),
        )


def decode_heads(ds_mla: bool, q_dtype: torch.dtype) -> int:
    """Query heads one decode program takes (the rows of its dots): ``BLOCK_H`` (16), or 32
    for fp8_ds_mla records with a 16-bit q. Each program dequantizes every [BLOCK_N, LATENT]
    tile it reads, so at 32 heads half as many programs dequantize each row; that work, not
    the bytes, set the fp8 cache's pace at batch 64 (723 us a layer on the H200 against 287
    for bf16 rows). ptxas for sm90 at the V3 shape, 64 keys: 32 heads at 8 warps spill 1,100
    bytes a thread and take 169 KB of shared memory, 16 heads at 4 warps 980 bytes and 151 KB;
    the bf16 rows at 32 heads spill 24 bytes, at 16 none (their 16 stays: through L2 the 8
    programs of a sequence now share the rows)."""
    return 32 if ds_mla and q_dtype != torch.float32 else BLOCK_H


def decode_launch(ds_mla: bool, q_dtype: torch.dtype, block_size: int) -> tuple[int, int]:
    """(BLOCK_N, num_warps) of the decode kernel, from `benchmarks/mla_decode.py --sweep` on
    the H200 at DeepSeek-V3's shape (128 heads, context 2048; benchmarks/results/
    mla_decode_h200.txt) within the shared memory Triton's compiler gives for sm90
    (LATENT 512, ROPE 64, ``decode_heads``; tests/test_mla_kernels.py checks every choice
    against sm90's 227 KB; fp32 records at BLOCK_N 32 once took 300 KB, a launch failure):

    - auto caches, 16-bit q: 64 keys, 8 warps (batch 1: 62 us against 137 at 32 keys and 4
      warps; batch 64: 287 us against 440);
    - auto caches, fp32 q: 32 keys, 4 warps (182 KB);
    - fp8_ds_mla, 16-bit q: the dequantized [BLOCK_N, LATENT] tile in q's dtype, 64 keys,
      32 heads and 8 warps (at 16 heads, 4 warps measured best: batch 64 723 us against
      1,093 at 32 keys and 8 warps; batch 1 even);
    - fp8_ds_mla, fp32 q (exact checks, not speed): 16 keys, 8 warps (73 KB).
    """
    if not ds_mla:
        return (min(block_size, 64), 8) if q_dtype != torch.float32 else (min(block_size, 32), 4)
    if q_dtype == torch.float32:
        return min(block_size, 16), 8
    return min(block_size, 64), 8


def mla_decode_splits(num_seqs: int, num_heads: int, device: torch.device) -> int:
    """Programs per (sequence, head tile) (``triton_common.decode_splits_for``), counting
    tiles of ``BLOCK_H`` heads whatever the cache (the caller does not know it)."""
    return decode_splits_for(num_seqs * triton.cdiv(num_heads, BLOCK_H), device)


def mla_decode_attention(
    q: torch.Tensor,  # [S, H, D]
    layer_cache: torch.Tensor,  # [N, 1, 1, B, D]
    context_lens: torch.Tensor,  # [S] int
    block_tables: torch.Tensor,  # [S, max_blocks] int
    scale: float,
    latent_dim: int,
    num_splits: int | None = None,
    sinks: torch.Tensor | None = None,  # [H] per-head sink logits (DeepSeek-V4's attention)
) -> torch.Tensor:  # [S, H, latent_dim]
    block_size, width = _check_cache(layer_cache)
    ds_mla = fp8_ds_mla.is_ds_mla(layer_cache.dtype)
    rope = record_rope(layer_cache, latent_dim) if ds_mla else width - latent_dim
    width = latent_dim + rope  # of q
    assert not untileable_sizes(latent_dim, rope), (
        f"the triton MLA kernel needs kv_lora_rank and the rope part to be powers of two "
        f">= 16, got {latent_dim} and {rope}"
    )
    num_seqs, num_heads, _ = q.shape
    assert q.shape[2] == width, f"q must be [S, H, {width}], got {tuple(q.shape)}"
    out = torch.empty((num_seqs, num_heads, latent_dim), dtype=q.dtype, device=q.device)
    if num_seqs == 0:
        return out
    splits = num_splits or mla_decode_splits(num_seqs, num_heads, q.device)
    sinks = check_sinks(sinks, num_heads)
    if not ds_mla:  # fp8_ds_mla: the dots run in q's dtype
        q = q.to(layer_cache.dtype)
    context_lens = context_lens.contiguous()
    part_acc = torch.empty(
        (num_seqs, num_heads, splits, latent_dim), dtype=torch.float32, device=q.device
    )
    part_ml = torch.empty((num_seqs, num_heads, splits, 2), dtype=torch.float32, device=q.device)
    stride_cn, _, _, stride_cb, stride_cd = layer_cache.stride()
    block_h = decode_heads(ds_mla, q.dtype)
    tiles = triton.cdiv(num_heads, block_h)
    block_n, num_warps = decode_launch(ds_mla, q.dtype, block_size)
    with _device_guard(q):
        _mla_decode_kernel[(tiles, splits, num_seqs)](
            out,
            q,
            layer_cache,
            context_lens,
            block_tables,
            part_acc,
            part_ml,
            part_ml if sinks is None else sinks,
            scale * _LOG2E,
            num_heads,
            *q.stride(),
            *out.stride(),
            stride_cn,
            stride_cb,
            stride_cd,
            *block_tables.stride(),
            *part_acc.stride()[:3],
            *part_ml.stride()[:3],
            LATENT=latent_dim,
            ROPE=rope,
            BLOCK_H=block_h,
            BLOCK_SIZE=block_size,
            BLOCK_N=block_n,
            SPLITS=splits,
            UPCAST=_INTERPRETED,
            DS_MLA=ds_mla,
            TILE=fp8_ds_mla.TILE,
            num_warps=num_warps,
            HAS_SINK=sinks is not None,
        )
    if splits > 1:
        reduce_splits(out, part_acc, part_ml, sinks, block_h=BLOCK_H)
    return out
