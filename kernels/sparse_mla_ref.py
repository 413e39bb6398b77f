"""DeepSeek-V3.2's sparse MLA over the tokens its indexer selected: the torch reference (the
CPU path, and the oracle of kernels/triton_sparse_mla.py).

Absorbed form, as common/model/layers/mla.py's decode: query ``t``'s heads ``q[t] [H, latent +
rope]`` (``q_nope @ W_UK``, then the rotated ``q_rope``) attend only the cached rows
``indices[t]`` (``-1``: none) of sequence ``query_seq[t]``; a row's key is its latent and
rope parts, its value its latent. A row of the auto cache is ``latent ++ rope (++ the
indexer key)`` in the model's dtype; of the fp8 cache (uint8) the 656-byte fp8_ds_mla record
(kernels/fp8_ds_mla.py), then the key's bytes. Softmax in float32; a query with no selected
row gets zeros. Output ``[T, H, latent]`` (callers apply ``W_UV``).
"""

from __future__ import annotations

import torch

from pdserve.kernels import fp8_ds_mla


def write_rows(
    cache: torch.Tensor,  # [N, B, row]
    rows: torch.Tensor,  # [T, row]
    slot_mapping: torch.Tensor,  # [T] int64, block_id * B + offset; negative: skipped
) -> None:
    """A row per token into its slot (fp8 caches: rows already their bytes)."""
    size = cache.shape[1]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    cache[slots // size, slots % size] = rows[keep].to(cache.dtype)


def check_args(
    q: torch.Tensor,
    cache: torch.Tensor,
    latent_dim: int,
    block_tables: torch.Tensor,
    query_seq: torch.Tensor,
    indices: torch.Tensor,
) -> int:  # the rope width
    if q.dim() != 3 or cache.dim() != 3:
        raise ValueError(f"q [T, H, D] and cache [N, B, row], got {q.shape}, {cache.shape}")
    rope = q.shape[2] - latent_dim
    if rope <= 0:
        raise ValueError(f"queries of {q.shape[2]} values for a latent of {latent_dim}")
    need = fp8_ds_mla.record_bytes(latent_dim, rope) if cache.dtype == torch.uint8 else q.shape[2]
    if cache.shape[2] < need:
        raise ValueError(f"cache rows of {cache.shape[2]}, the latent and rope need {need}")
    if indices.dim() != 2 or indices.shape[0] != q.shape[0] or query_seq.shape != q.shape[:1]:
        raise ValueError("indices [T, topk] and query_seq [T] for the T queries")
    if block_tables.dim() != 2:
        raise ValueError(f"block_tables must be [S, max_blocks], got {block_tables.shape}")
    return rope


def gather_selected(
    cache: torch.Tensor,  # [N, B, row]
    latent_dim: int,
    rope_dim: int,
    block_tables: torch.Tensor,  # [S, max_blocks]
    query_seq: torch.Tensor,  # [T]
    indices: torch.Tensor,  # [T, K]; -1: none (row 0 of the sequence's first block read)
    dtype: torch.dtype,
) -> torch.Tensor:  # [T, K, latent + rope] in dtype (fp8 records dequantized)
    size = cache.shape[1]
    pos = indices.long().clamp_min(0)
    blocks = block_tables[query_seq.long()[:, None], pos // size].long()
    rows = cache[blocks, pos % size]  # [T, K, row]
    if cache.dtype == torch.uint8:
        record = rows[..., : fp8_ds_mla.record_bytes(latent_dim, rope_dim)]
        return fp8_ds_mla.dequantize_rows(record, latent_dim, dtype)
    return rows[..., : latent_dim + rope_dim].to(dtype)


def sparse_mla_attention(
    q: torch.Tensor,  # [T, H, latent + rope]: absorbed queries
    cache: torch.Tensor,  # [N, B, row]: one layer's rows (uint8: fp8 records)
    latent_dim: int,  # kv_lora_rank
    block_tables: torch.Tensor,  # [S, max_blocks] int32
    query_seq: torch.Tensor,  # [T] int32: each query's row of block_tables
    indices: torch.Tensor,  # [T, topk] int32: selected positions, -1 none
    scale: float,
) -> torch.Tensor:  # [T, H, latent]
    rope = check_args(q, cache, latent_dim, block_tables, query_seq, indices)
    if q.shape[0] == 0:
        return q.new_empty((0, q.shape[1], latent_dim))
    rows = gather_selected(cache, latent_dim, rope, block_tables, query_seq, indices, q.dtype)
    rows = rows.masked_fill((indices < 0)[..., None], 0.0)  # a -1's stand-in row may be NaN
    logits = torch.einsum("thd,tkd->thk", q.float(), rows.float()) * scale  # [T, H, K]
    chosen = (indices >= 0)[:, None, :]
    logits = logits.masked_fill(~chosen, float("-inf"))
    probs = torch.softmax(logits, dim=-1).nan_to_num(0.0)  # no row chosen: zeros
    out = torch.einsum("thk,tkl->thl", probs, rows[..., :latent_dim].float())
    return out.to(q.dtype)
