"""DeepSeek-V4's paged maths as batched torch ops: the reference of kernels/triton_v4.py
and the CPU path of common/model/deepseek/dsv4_attention.py (no loop over sequences: every
sequence of a step in one call, addressed through per-row slot lists the caller builds
once per step).

A V4 cache is one layer's view ``[N, 1, 1, B, row]`` of the engine's cache; a slot is
``block_id * B + offset``, negative: nothing (masked, or a write skipped). Rows of an
``auto`` cache hold values in the cache dtype; a uint8 cache holds kernels/fp8_ds_v4.py's
fp8 rows (``Fp8Rows``: the dims needed to read them), dequantized as they are read.

* ``write_rows``: a row per token into its slot.
* ``compress``: each closed window pooled into one entry: per channel
  ``sum_j softmax_j(gate_j + ape_j) * kv_j`` over the window's token rows (CSA: 2m rows, the
  previous window's first series then this window's second; slots of the missing previous
  window of window 0 negative), then the RMSNorm (weight); the rope is the caller's.
* ``sink_attention``: each query attends the K=V rows of its window slots and its entry
  slots (one shared head, K = V), with a per-head sink logit in the softmax's
  denominator, accumulated in float32.
(The lightning indexer's top-k is ``kernels.indexer_topk``: kernels/indexer_ref.py.)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.kernels import fp8_ds_v4

QUERY_CHUNK = 512  # queries gathered at a time (bounds [t, keys, D] of the reference)


@dataclass(frozen=True)
class Fp8Rows:
    """How to read a uint8 V4 cache's rows (kernels/fp8_ds_v4.py)."""

    head_dim: int
    rope_dim: int
    index_dim: int = 0  # entries: CSA's indexer key after the K=V record; 0: none


def gather(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """[..., row] raw rows of ``slots`` (negative ones read slot 0: mask them)."""
    size = cache.shape[3]
    s = slots.long().clamp_min(0)
    return cache[s // size, 0, 0, s % size]


def rows_values(raw: torch.Tensor, fp8: Fp8Rows | None, dtype: torch.dtype) -> torch.Tensor:
    """Per-token rows as the auto cache holds them ([..., row] in ``dtype``)."""
    if fp8 is None:
        return raw.to(dtype)
    lead = raw.shape[:-1]
    flat = fp8_ds_v4.unpack_rows(raw.reshape(-1, raw.shape[-1]), fp8.head_dim, fp8.rope_dim, dtype)
    return flat.reshape(*lead, flat.shape[-1])


def kv_values(raw: torch.Tensor, fp8: Fp8Rows | None, head_dim: int, dtype: torch.dtype):
    """The K=V part ([..., head_dim]) of rows or entries."""
    if fp8 is None:
        return raw[..., :head_dim].to(dtype)
    cut = fp8_ds_v4.kv_bytes(fp8.head_dim, fp8.rope_dim)
    return fp8_ds_v4.dequantize_kv(raw[..., :cut], fp8.head_dim, fp8.rope_dim, dtype)


def write_rows(
    cache: torch.Tensor,  # [N, 1, 1, B, row]
    rows: torch.Tensor,  # [T, row] in the cache dtype (fp8: packed bytes)
    slots: torch.Tensor,  # [T] int64; negative: skipped
) -> None:
    size = cache.shape[3]
    keep = slots >= 0
    s = slots[keep]
    cache[s // size, 0, 0, s % size] = rows[keep].to(cache.dtype)


def compress(
    cache: torch.Tensor,  # [N, 1, 1, B, row]: per-token rows
    slots: torch.Tensor,  # [P, L] int64: each closing window's rows (L = m, or 2m: overlap)
    offset: int,  # where the compressor's kv then gate start in a row (values)
    ape: torch.Tensor,  # [m, C]: position bias of the gate (C: d, or 2d with overlap)
    weight: torch.Tensor,  # [d]: the RMSNorm's
    eps: float,
    overlap: bool,
    dtype: torch.dtype,  # the model's (the rows' values, the result's)
    fp8: Fp8Rows | None = None,
) -> torch.Tensor:  # [P, d]
    m, width = ape.shape
    d = weight.shape[0]
    num = slots.shape[0]
    rows = rows_values(gather(cache, slots), fp8, dtype)  # [P, L, row]
    kv = rows[..., offset : offset + width]
    gate = rows[..., offset + width : offset + 2 * width]
    if overlap:  # slot j < m: the previous window's first series; j >= m: this one's second
        kv = torch.cat((kv[:, :m, :d], kv[:, m:, d:]), dim=1)
        gate = torch.cat((gate[:, :m, :d] + ape[:, :d], gate[:, m:, d:] + ape[:, d:]), dim=1)
    else:
        gate = gate + ape
    gate = gate.masked_fill((slots < 0)[..., None], float("-inf"))
    kv = kv.masked_fill((slots < 0)[..., None], 0)
    pooled = (kv * gate.softmax(dim=1, dtype=torch.float32).to(kv.dtype)).sum(dim=1)
    h = pooled.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (weight * h).to(dtype).reshape(num, d)


def sink_attention(
    q: torch.Tensor,  # [T, H, D]
    rows_cache: torch.Tensor,  # [N, 1, 1, B, row]: K=V rows first D values
    window_slots: torch.Tensor,  # [T, W] int64; negative: not seen
    entries_cache: torch.Tensor | None,  # [N, 1, 1, B, row]
    entry_slots: torch.Tensor | None,  # [T, E] int64; negative: not seen
    sinks: torch.Tensor,  # [H]
    scale: float,
    fp8: Fp8Rows | None = None,  # both caches' rows when uint8
) -> torch.Tensor:  # [T, H, D] in q's dtype
    num, d = q.shape[0], q.shape[-1]
    out = torch.empty_like(q)
    for lo in range(0, num, QUERY_CHUNK):  # over query chunks: memory, not sequences
        hi = min(num, lo + QUERY_CHUNK)
        slots = window_slots[lo:hi]
        kv = kv_values(gather(rows_cache, slots), fp8, d, q.dtype)
        if entries_cache is not None and entry_slots is not None and entry_slots.shape[1]:
            es = entry_slots[lo:hi]
            entries = kv_values(gather(entries_cache, es), fp8, d, q.dtype)
            kv, slots = torch.cat((kv, entries), dim=1), torch.cat((slots, es), dim=1)
        kv = kv.masked_fill((slots < 0)[..., None], 0)  # what a masked slot reads: nothing
        logits = torch.einsum("thd,tkd->thk", q[lo:hi], kv) * scale  # [t, H, K]
        logits = logits.masked_fill((slots < 0)[:, None, :], float("-inf"))
        sink = sinks.to(logits.dtype)[None, :, None].expand(hi - lo, -1, 1)
        logits = torch.cat((logits, sink), dim=-1)
        logits = logits - logits.max(dim=-1, keepdim=True).values
        probs = torch.softmax(logits, dim=-1)[..., :-1]
        out[lo:hi] = torch.einsum("thk,tkd->thd", probs.to(kv.dtype), kv)
    return out
