"""Triton kernels for an MLA latent cache, with the signatures of kernels/mla_reference.py.

One layer's cache is the strided view ``[N, 1, 1, B, D]``, D = LATENT + ROPE: per token the
latent (kv_lora_rank values) then the rotated rope key. The absorbed decode attends it
as multi-query attention: query head h's row ``q[s, h]`` (D values: q_nope through W_UK,
then q_rope) scores ``q . row`` against every cached row, and the output is the softmax
over those scores applied to the rows' latent parts (LATENT values).

``_mla_decode_kernel``: one program per (sequence, BLOCK_H query heads, split). The heads
of the tile are the rows of ``tl.dot``, so each latent row is read once per BLOCK_H heads
(DeepSeek-V3: 128 heads, 8 reads per step at BLOCK_H = 16, 2 at 64, against 128 for
per-head K/V). The head tiles are the grid's fastest axis, then the splits, then the
sequences: the programs that read the same rows are launched side by side and run
together, so the rows come from memory once and from L2 the other times. (With the
sequence fastest, as before, a batch of 64 ran the programs of one head tile for every
sequence at once, and read every latent row from memory 8 times: at DeepSeek-V3's shape,
context 2048, 287 us a layer on the H200 where its 151 MB take 31.) The keys are walked
as one flat loop of BLOCK_N-key tiles (the block id of each from the table), which
Triton pipelines (``num_stages``: asynchronous copies into shared memory); at BLOCK_H = 64
both dots are Hopper's warpgroup MMA (M = 64). The launch shape by cache and batch:
``decode_tile`` (``DECODE_TILES``).
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
cast to the cache's dtype.

Constraints: LATENT and ROPE powers of two >= 16 (DeepSeek: 512 and 64), block_size a
power of two >= 16. Under Triton's interpreter (``TRITON_INTERPRET=1``) operands are
upcast to fp32 (the interpreter has no bfloat16 arithmetic).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from pdserve.kernels import fp8_ds_mla, triton_common
from pdserve.kernels.triton_common import (
    _LOG2E,
    MAX_DECODE_SPLITS,
    _device_guard,
    _is_pow2,
    check_sinks,
    finish_rows,
    reduce_splits,
    store_partials,
)
from pdserve.kernels.triton_mla_fp8 import load_ds_mla, record_rope, write_ds_mla


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
    LAZY: tl.constexpr,  # skip the accumulator's rescale while no row's max grew by 2^8
    IDS: tl.constexpr,  # block ids loaded at once (a power of two)
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

    # key tiles of BLOCK_N keys, SUBS a cache block; a split takes a run of whole blocks.
    # Their block ids are loaded IDS at a time, before the loop over those blocks' tiles:
    # a tile's id taken from the table inside that loop was a load the next tile's rows
    # depend on, which made Triton's pipeliner wait for every copy in flight at each tile
    # (the rows then arrived one tile at a time, not overlapping the dots).
    SUBS: tl.constexpr = BLOCK_SIZE // BLOCK_N
    b_hi = tl.cdiv(ctx, BLOCK_SIZE)
    b_lo = 0
    if SPLITS > 1:
        per_split = tl.cdiv(b_hi, SPLITS)
        b_lo = split * per_split
        b_hi = tl.minimum(b_hi, b_lo + per_split)
    t_end = tl.cdiv(ctx, BLOCK_N)  # no tile wholly past the context

    m_i = tl.full([BLOCK_H], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, LATENT], tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    table = block_tables_ptr + seq * stride_bts
    ib = tl.arange(0, IDS)
    for b0 in range(b_lo, b_hi, IDS):
        ids = tl.load(table + (b0 + ib) * stride_btb, mask=b0 + ib < b_hi, other=0)  # [IDS]
        t_lo = b0 * SUBS
        for t in range(t_lo, tl.minimum(tl.minimum(b0 + IDS, b_hi) * SUBS, t_end)):
            block_id = tl.sum(tl.where(ib == (t - t_lo) // SUBS, ids, 0), 0).to(tl.int64)
            offs = (t % SUBS) * BLOCK_N + offs_n  # [N] offsets in the block
            k_ok = t * BLOCK_N + offs_n < ctx
            rows = cache_ptr + block_id * stride_cn + offs[:, None] * stride_cb
            if DS_MLA:  # dequantized once into q's dtype, used by both dots
                c, r = load_ds_mla(cache_ptr + block_id * stride_cn + offs * stride_cb, k_ok, LATENT,
                                   ROPE, TILE, q_lat.dtype)  # fmt: skip
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
            if LAZY:  # rescale only once some row's max grew past 2^8: p <= 256 meanwhile
                if tl.max(m_new - m_i, 0) > 8.0:
                    alpha = tl.exp2(m_i - m_new)
                    acc = acc * alpha[:, None]
                    l_i = l_i * alpha
                    m_i = m_new
                p = tl.where(visible, tl.exp2(s - m_i[:, None]), 0.0)
                l_i += tl.sum(p, 1)
                acc = tl.dot(p.to(c.dtype), c, acc, input_precision="ieee")
            else:
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


@dataclass(frozen=True)
class DecodeTile:
    """One launch shape of ``_mla_decode_kernel``."""

    block_h: int  # query heads a program: the rows of its dots (>= 16, a power of two)
    block_n: int  # keys a tile (a power of two >= 16; capped at the cache's block size)
    num_warps: int
    num_stages: int  # the key loop's software pipeline (Triton's num_stages)
    waves: float = 2.0  # the splits aim at waves x SMs programs (at most, 1 split at least)
    lazy: bool = False  # rescale the [BLOCK_H, LATENT] accumulator only when a row's running
    # max grew by 2^8 or more (else p is taken against the stale max, <= 256): at 64 heads
    # and 8 warps 128 multiplies a thread and tile saved, most tiles


DECODE_IDS = 32  # block ids the decode kernel loads at once: its key loop's pipeline restarts
# every DECODE_IDS blocks (2,048 keys at block 64)
SMALL_BATCH = 8  # batches up to this many sequences are "small" (a CUDA-graph size: a
# step and its padded replay fall on the same side, so they pick the same tile)

# (cache, batch regime) -> tile, for 16-bit q; `benchmarks/mla_decode.py --sweep` times the
# candidates at DeepSeek-V3's shape (its printed ``DECODE_TILES`` line is the table to set).
# "small": 16 heads a program, many splits (a batch of 1 is 32 splits x 8 head tiles);
# "large" (issue #47: batch 64): 64 heads a program, two programs a sequence, each latent
# row read twice rather than 8 times and, for fp8_ds_mla, dequantized twice; the dots' 64
# rows fill Hopper's warpgroup MMA (M = 64), 16 rows take the older mma at a quarter of it.
# The large regime's entries are still the tiles measured before issue #47 (16 heads auto,
# 32 fp8; 64 keys, 8 warps): the 64-head tiles below compile for sm90 and match the
# reference, but no GPU has timed them yet (the session that wrote them got no device
# time); the sweep's printed line replaces these once one has.
DECODE_TILES: dict[tuple[str, str], DecodeTile] = {
    ("auto", "small"): DecodeTile(16, 64, 8, 3),
    ("auto", "large"): DecodeTile(16, 64, 8, 3, 2.0),
    ("fp8", "small"): DecodeTile(32, 64, 8, 3),
    ("fp8", "large"): DecodeTile(32, 64, 8, 3, 2.0),
}
# The candidates `benchmarks/mla_decode.py --sweep` times beside the defaults (batch 1 for
# "small", 64 for "large"), all checked against the reference under Triton's interpreter
# (tests/test_mla_kernels.py). ptxas for sm90 at the V3 shape, 8 warps (registers, bytes
# of spill, shared memory): the key loop pipelines only at 3 stages or more (at 2 each
# tile's copies are issued after the previous tile's dots and waited for before its own).
# auto 64 heads: 32 keys 3 stages 255 / 96 / 184 KB, 4 stages 112 / 221 KB; 16 keys 4
# stages 44 / 147 KB; 64 keys 3 stages 295 KB (over sm90's 227), 2 stages unpipelined.
# fp8_ds_mla 64 heads: 32 keys 3 stages 255 / 48 / 152 KB; 16 keys 4 stages 32 / 131 KB;
# 64 keys 3 stages 176 / 231 KB. 16 heads 64 keys 3 stages: auto 217 registers, no spill.
SWEEP_TILES: dict[tuple[str, str], tuple[DecodeTile, ...]] = {
    ("auto", "small"): (
        DecodeTile(16, 64, 8, 3, 1.0),
        DecodeTile(16, 32, 4, 3),
        DecodeTile(32, 64, 8, 3),
        DecodeTile(64, 32, 8, 3),
    ),
    ("auto", "large"): (
        DecodeTile(64, 32, 8, 3, 1.0),  # the 64-head tile proposed as the default
        DecodeTile(64, 16, 8, 4, 1.0),
        DecodeTile(64, 32, 8, 4, 1.0),
        DecodeTile(64, 16, 8, 6, 1.0),
        DecodeTile(64, 32, 8, 3, 2.0),
        DecodeTile(64, 32, 8, 3, 1.0, lazy=True),
        DecodeTile(64, 64, 8, 2, 1.0),
    ),
    ("fp8", "small"): (
        DecodeTile(32, 64, 8, 3, 1.0),
        DecodeTile(16, 64, 8, 3),
        DecodeTile(64, 32, 8, 3),
    ),
    ("fp8", "large"): (
        DecodeTile(64, 32, 8, 3, 1.0),  # the 64-head tile proposed as the default
        DecodeTile(64, 16, 8, 4, 1.0),
        DecodeTile(64, 32, 8, 4, 1.0),
        DecodeTile(64, 64, 8, 3, 1.0),
        DecodeTile(64, 32, 8, 3, 2.0),
        DecodeTile(64, 32, 8, 3, 1.0, lazy=True),
    ),
}
# float32 q (exact checks, not speed): within sm90's shared memory (tests/test_mla_kernels.py)
FP32_TILES = {"auto": DecodeTile(16, 32, 4, 3), "fp8": DecodeTile(16, 16, 8, 3)}


def decode_regime(num_seqs: int) -> str:
    return "small" if num_seqs <= SMALL_BATCH else "large"


def decode_tile(ds_mla: bool, q_dtype: torch.dtype, block_size: int, num_seqs: int) -> DecodeTile:
    """The decode kernel's launch shape for a cache (auto or fp8_ds_mla records), q's dtype
    and the batch (``DECODE_TILES``; earlier measurements, H200, block 64, context 2048:
    auto 16 heads / 64 keys / 8 warps took 62 us at batch 1 against 137 at 32 keys and 4
    warps, 287 at batch 64 against 440; fp8_ds_mla at 32 heads 723 us at batch 64, each
    program dequantizing every row it reads, 16 heads worse; benchmarks/results/
    mla_decode_sweep_h200.txt). BLOCK_N is capped at ``block_size``."""
    cache = "fp8" if ds_mla else "auto"
    if q_dtype == torch.float32:
        tile = FP32_TILES[cache]
    else:
        tile = DECODE_TILES[(cache, decode_regime(num_seqs))]
    if tile.block_n > block_size:
        tile = replace(tile, block_n=block_size)
    return tile


def mla_decode_splits(
    num_seqs: int, num_heads: int, device: torch.device, ds_mla: bool = False
) -> int:
    """Programs per (sequence, head tile): the most that keep the batch within the tile's
    ``waves`` x SMs programs (at least 1, at most ``MAX_DECODE_SPLITS``), counting the head
    tiles of the batch's ``decode_tile`` for 16-bit q (the caller does not know the cache:
    without ``ds_mla`` the auto cache's tile, which the engine asks for both). The split
    changes the summation order: a step and its CUDA-graph replay ask with the same padded
    batch. Off CUDA (the interpreter) 1: tests pass theirs."""
    if device.type != "cuda":
        return 1
    tile = decode_tile(ds_mla, torch.bfloat16, 64, num_seqs)
    index = device.index if device.index is not None else torch.cuda.current_device()
    tiles = num_seqs * triton.cdiv(num_heads, tile.block_h)
    return max(1, min(MAX_DECODE_SPLITS, int(tile.waves * triton_common._num_sms(index)) // tiles))


def reduce_heads(splits: int) -> int:
    """Heads a program of the splits' reduce takes, from the split count (which a step and
    its CUDA-graph replay share, unlike their batch sizes: the summation's layout follows
    it): 32 // splits as a power of two, 1 to 16. Many splits are a small batch, whose
    partials then spread over more programs (a batch of 1 at 128 heads, 32 splits: 8 MB
    over 128 programs, where at 16 heads a program 8 programs read 1 MB each)."""
    return min(16, 1 << (max(1, 32 // splits).bit_length() - 1))


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
    splits = num_splits or mla_decode_splits(num_seqs, num_heads, q.device, ds_mla)
    sinks = check_sinks(sinks, num_heads)
    if not ds_mla:  # fp8_ds_mla: the dots run in q's dtype
        q = q.to(layer_cache.dtype)
    context_lens = context_lens.contiguous()
    part_acc = torch.empty(
        (num_seqs, num_heads, splits, latent_dim), dtype=torch.float32, device=q.device
    )
    part_ml = torch.empty((num_seqs, num_heads, splits, 2), dtype=torch.float32, device=q.device)
    stride_cn, _, _, stride_cb, stride_cd = layer_cache.stride()
    tile = decode_tile(ds_mla, q.dtype, block_size, num_seqs)
    tiles = triton.cdiv(num_heads, tile.block_h)
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
            BLOCK_H=tile.block_h,
            BLOCK_SIZE=block_size,
            BLOCK_N=tile.block_n,
            SPLITS=splits,
            UPCAST=_INTERPRETED,
            DS_MLA=ds_mla,
            TILE=fp8_ds_mla.TILE,
            HAS_SINK=sinks is not None,
            LAZY=tile.lazy,
            IDS=DECODE_IDS,
            num_warps=tile.num_warps,
            num_stages=tile.num_stages,
        )
    if splits > 1:
        reduce_splits(out, part_acc, part_ml, sinks, block_h=reduce_heads(splits))
    return out
