"""The lightning indexer's top-k in Triton, with kernels/indexer_ref.py's signature and
semantics (the score of each visible key, the ``topk`` highest, ``-1`` past the visible).

Two passes: a Triton kernel scores every key of the query's sequence, one program per
(query, tile of ``BLOCK_K`` keys), reading the keys straight from the paged cache through
the block table (fp8 keys dequantized in the kernel: fp8 values times their tile's float32
scale) into a float32 ``[T, L]`` buffer, ``-inf`` past the query's visible keys; then
``top_lowest_ties`` picks each row's best, equal scores by lower index, so the choice does
not depend on the row's width (``row_keys``, which the reference needs to resolve ties as
transformers' CPU torch.topk does, is not used: no GPU order matches that one anyway).
``L`` is the block tables' reach (``max_blocks * B``), known on the host: nothing is read
back from the GPU, so a CUDA graph can capture it.
Queries run in chunks that keep the buffer under ``SCORE_BUDGET`` floats (long prefills at
100k+ keys).

The dot ``q[h] . key`` runs in float32 (``ieee``: no TF32); the head-weighted sum is a
reduction over the heads, so scores equal the reference's to rounding; near-equal scores
may order differently.

Constraints: ``D`` a power of two >= 16 (fp8 keys: a multiple of 128); the scales of
fp8 keys are read byte by byte, so a key may start at any byte of its row.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.kernels import fp8_ds_mla
from pdserve.kernels.indexer_ref import KeyFormat, check_args
from pdserve.kernels.triton_common import _device_guard, _is_pow2

SCORE_BUDGET = 1 << 27  # float32 scores held at once (512 MiB; int64 keys: half as many)
BLOCK_K = 32  # keys per program


@triton.jit
def _tile_scales(scales, d, ok, KEY_TILE: tl.constexpr):
    # [K, D] float32: the scale of each value's tile, its 4 bytes (little-endian) assembled,
    # so a scale need not be 4-byte aligned (V4's entries put the key at any byte)
    at = scales[:, None] + 4 * (d // KEY_TILE)[None, :]
    bits = tl.load(at, mask=ok[:, None], other=0).to(tl.uint32)
    bits |= tl.load(at + 1, mask=ok[:, None], other=0).to(tl.uint32) << 8
    bits |= tl.load(at + 2, mask=ok[:, None], other=0).to(tl.uint32) << 16
    bits |= tl.load(at + 3, mask=ok[:, None], other=0).to(tl.uint32) << 24
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _index_scores_kernel(
    q_ptr,  # [T, H, D]
    w_ptr,  # [T, H] float32
    cache_ptr,  # [N, B, row]
    tables_ptr,  # [S, max_blocks] int32
    seq_ptr,  # [T] int32
    vis_ptr,  # [T] int32
    out_ptr,  # [T, L] float32
    stride_qt,
    stride_qh,
    stride_qd,
    stride_wt,
    stride_wh,
    stride_cn,
    stride_cb,
    stride_ts,
    stride_ot,
    num_keys,  # L
    num_heads,
    scale,
    OFFSET: tl.constexpr,  # the key's first element (fp8: byte) in a row
    D: tl.constexpr,
    H_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,  # cache block
    BLOCK_K: tl.constexpr,
    FP8: tl.constexpr,
    KEY_TILE: tl.constexpr,
    KEYS: tl.constexpr,  # store top_lowest_ties' int64 keys (see there), not the scores
):
    t = tl.program_id(0).to(tl.int64)
    kb = tl.program_id(1)
    seq = tl.load(seq_ptr + t).to(tl.int64)
    nvis = tl.load(vis_ptr + t)
    p = kb * BLOCK_K + tl.arange(0, BLOCK_K)  # key positions
    in_row = p < num_keys
    ok = p < nvis
    if kb * BLOCK_K < nvis:  # tiles past the visible keys (a graph's wide tables) skip the dot
        h = tl.arange(0, H_PAD)
        d = tl.arange(0, D)
        h_ok = h < num_heads
        q = tl.load(
            q_ptr + t * stride_qt + h[:, None] * stride_qh + d[None, :] * stride_qd,
            mask=h_ok[:, None],
            other=0.0,
        ).to(tl.float32)  # [H_PAD, D]
        w = tl.load(w_ptr + t * stride_wt + h * stride_wh, mask=h_ok, other=0.0).to(tl.float32)
        blk = tl.load(tables_ptr + seq * stride_ts + p // BLOCK_SIZE, mask=ok, other=0).to(tl.int64)
        rows = cache_ptr + blk * stride_cn + (p % BLOCK_SIZE).to(tl.int64) * stride_cb + OFFSET
        if FP8:
            raw = tl.load(rows[:, None] + d[None, :], mask=ok[:, None], other=0)  # uint8
            k = raw.to(tl.float8e4nv, bitcast=True).to(tl.float32) * _tile_scales(rows + D, d, ok,
                                                                                  KEY_TILE)  # fmt: skip
        else:
            k = tl.load(rows[:, None] + d[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale  # [H_PAD, BLOCK_K]
        s = tl.maximum(s, 0.0)
        index = tl.sum(s * w[:, None], 0)  # [BLOCK_K]
        index = tl.where(ok, index, float("-inf"))
        if KEYS:
            tl.store(out_ptr + t * stride_ot + p, _score_keys(index, p), mask=in_row)
        else:
            tl.store(out_ptr + t * stride_ot + p, index, mask=in_row)
    else:
        ninf = tl.full((BLOCK_K,), float("-inf"), tl.float32)
        if KEYS:
            tl.store(out_ptr + t * stride_ot + p, _score_keys(ninf, p), mask=in_row)
        else:
            tl.store(out_ptr + t * stride_ot + p, ninf, mask=in_row)


@triton.jit
def _score_keys(score, p):
    # top_lowest_ties' key of each score at its index p: an int64, unique, ordered as
    # (score, then lower index); -0.0 taken as +0.0
    score = tl.where(score == 0.0, 0.0, score)
    bits = score.to(tl.int32, bitcast=True)
    ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    return (ordered.to(tl.int64) << 32) - p.to(tl.int64)


def index_scores(
    q: torch.Tensor,  # [T, H, D]
    weights: torch.Tensor,  # [T, H] float32
    key_cache: torch.Tensor,  # [N, B, row]
    key_format: KeyFormat,
    block_tables: torch.Tensor,  # [S, max_blocks] int32
    query_seq: torch.Tensor,  # [T] int32
    num_visible: torch.Tensor,  # [T] int32
    keys: bool = False,  # int64 keys of (score, lower index): top_lowest_ties's, for top_of_keys
) -> torch.Tensor:  # [T, max_blocks * B] float32, -inf past each query's visible keys
    num_tokens, num_heads, dim = q.shape
    block_size = key_cache.shape[1]
    num_keys = block_tables.shape[1] * block_size
    assert _is_pow2(dim) and dim >= 16, f"the indexer kernel needs a power-of-two D >= 16: {dim}"
    assert key_cache.stride(-1) == 1, "the key cache's rows must be contiguous"
    if key_format.fp8:
        fp8_ds_mla.key_bytes(dim)  # D a multiple of 128
    dtype = torch.int64 if keys else torch.float32
    out = torch.empty((num_tokens, num_keys), dtype=dtype, device=q.device)
    if num_tokens == 0 or num_keys == 0:
        return out
    tables = block_tables if block_tables.dtype == torch.int32 else block_tables.int()
    with _device_guard(q):
        _index_scores_kernel[(num_tokens, triton.cdiv(num_keys, BLOCK_K))](
            q,
            weights,
            key_cache,
            tables,
            query_seq.int().contiguous(),
            num_visible.int().contiguous(),
            out,
            *q.stride(),
            *weights.stride(),
            key_cache.stride(0),
            key_cache.stride(1),
            tables.stride(0),
            out.stride(0),
            num_keys,
            num_heads,
            dim**-0.5,
            OFFSET=key_format.offset,
            D=dim,
            H_PAD=max(16, triton.next_power_of_2(num_heads)),
            BLOCK_SIZE=block_size,
            BLOCK_K=BLOCK_K,
            FP8=key_format.fp8,
            KEY_TILE=fp8_ds_mla.KEY_TILE,
            KEYS=keys,
        )
    return out


def indexer_topk(
    q: torch.Tensor,
    weights: torch.Tensor,
    key_cache: torch.Tensor,
    key_format: KeyFormat,
    block_tables: torch.Tensor,
    query_seq: torch.Tensor,
    num_visible: torch.Tensor,
    topk: int,
    row_keys: torch.Tensor | None = None,
) -> torch.Tensor:  # [T, topk] int32
    check_args(q, weights, key_cache, key_format, block_tables, query_seq, num_visible, topk)
    num_tokens = q.shape[0]
    num_keys = block_tables.shape[1] * key_cache.shape[1]
    if num_tokens == 0 or min(topk, num_keys) == 0:
        return torch.full((num_tokens, topk), -1, dtype=torch.int32, device=q.device)
    chunk = max(1, SCORE_BUDGET // (2 * num_keys))  # int64 keys: twice a float's bytes
    # row_keys is not needed here: ties resolve by index, at any row width
    parts = [
        top_of_keys(
            index_scores(
                q[lo : lo + chunk],
                weights[lo : lo + chunk],
                key_cache,
                key_format,
                block_tables,
                query_seq[lo : lo + chunk],
                num_visible[lo : lo + chunk],
                keys=True,
            ),
            topk,
        )
        for lo in range(0, num_tokens, chunk)
    ]
    return parts[0] if len(parts) == 1 else torch.cat(parts)  # a decode step: one part


def top_lowest_ties(scores: torch.Tensor, topk: int) -> torch.Tensor:
    """[n, L] float32 scores (-inf: not visible) -> [n, topk] int32: each row's ``topk``
    best in descending score, equal scores by lower index first, -1 past the visible ones.

    Unlike a plain torch.topk (whose choice among equal scores depends on the row's width),
    the answer does not depend on how far the row is padded with -inf: a PCP piece, a
    monolithic prefill and a decode step ranked over a CUDA graph's wider tables all keep the
    same keys. Fixed shapes and no host read (CUDA graphs capture it), in few launches (a
    decode step's graph is bound by its node count): each score and its index made one
    int64 key, unique, ordered as (score, then lower index) -- the float's bits mapped to an
    order-preserving integer above, ``-index`` below -- so one torch.topk of the keys,
    sorted, is the answer."""
    width = scores.shape[1]
    bits = (scores + 0.0).view(torch.int32)  # + 0.0: -0.0 made +0.0 (they compare equal)
    # negative floats' magnitude bits flipped: the int32 order is then the float order
    ordered = (bits ^ ((bits >> 31) & 0x7FFFFFFF)).long()
    return top_of_keys((ordered << 32) - torch.arange(width, device=scores.device), topk)


def top_of_keys(keys: torch.Tensor, topk: int) -> torch.Tensor:
    """[n, L] int64 keys (top_lowest_ties', or index_scores(keys=True)) -> [n, topk] int32:
    the indices of each row's ``topk`` highest keys in descending order, -1 for -inf's."""
    num_rows, width = keys.shape
    kk = min(topk, width)
    if num_rows == 0 or kk == 0:
        return torch.full((num_rows, topk), -1, dtype=torch.int32, device=keys.device)
    top = keys.topk(kk, dim=-1)
    # -inf's key, (ordered(-inf) << 32) - index, lies below every finite score's
    best = torch.where(top.values > _NEG_INF_KEY, top.indices, -1).to(torch.int32)
    if kk == topk:
        return best
    out = torch.full((num_rows, topk), -1, dtype=torch.int32, device=keys.device)
    out[:, :kk] = best
    return out


_NEG_INF_BITS = -(2**23)  # float32 -inf (0xFF800000) as an int32
_NEG_INF_KEY = (_NEG_INF_BITS ^ 0x7FFFFFFF) << 32
