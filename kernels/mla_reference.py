"""Torch reference kernels for an MLA latent cache (used on CPU; the oracle for Triton).

One layer's latent cache is the view ``[N, 1, 1, B, D]`` of ``[N, L, 1, 1, B, D]``
(common/engine/kv_layout.py with ``num_kv_parts = 1``): per token one row of D values,
the latent (its first ``latent_dim`` values, ``kv_lora_rank``) then the rotated key part
shared by all heads. In the absorbed form every query head attends this one row as its key
and its first ``latent_dim`` values as its value, i.e. multi-query attention with one KV
head of width D whose value is the key's prefix; the reference runs the GQA reference of
kernels/reference.py over a view that shows the row as both K and V.

fp8 caches (``--kv-cache-dtype fp8``) are uint8 with D the bytes of one fp8_ds_mla record
(kernels/fp8_ds_mla.py, 656 for DeepSeek-V3): ``write_latent`` quantizes each row into its
record, the readers dequantize the blocks they read (into q's dtype) and attend as above.
"""

from __future__ import annotations

import torch

from pdserve.kernels import fp8_ds_mla, reference


def as_kv(layer_cache: torch.Tensor) -> torch.Tensor:
    """``[N, 1, 1, B, D]`` seen as ``[N, 2, 1, B, D]``: K and V both the latent row (stride 0)."""
    assert layer_cache.dim() == 5 and layer_cache.shape[1] == 1 and layer_cache.shape[2] == 1, (
        f"an MLA layer cache is [N, 1, 1, block_size, D], got {tuple(layer_cache.shape)}"
    )
    return layer_cache.expand(-1, 2, -1, -1, -1)


def _need_latent_dim(latent_dim: int | None) -> int:
    if latent_dim is None:
        raise ValueError("an fp8_ds_mla latent cache (uint8) needs latent_dim (kv_lora_rank)")
    return latent_dim


def write_latent(
    layer_cache: torch.Tensor,  # [N, 1, 1, B, D]
    latent: torch.Tensor,  # [T, latent_dim + rope]
    slot_mapping: torch.Tensor,  # [T] int64, block_id * B + offset; negative: padding
    latent_dim: int | None = None,  # kv_lora_rank: needed by fp8_ds_mla (uint8) caches
) -> None:
    block_size = layer_cache.shape[3]
    keep = slot_mapping >= 0
    slot_mapping, latent = slot_mapping[keep], latent[keep]
    if fp8_ds_mla.is_ds_mla(layer_cache.dtype):
        dim = _need_latent_dim(latent_dim)
        latent = fp8_ds_mla.quantize(latent[:, :dim], latent[:, dim:])  # [T, record] uint8
    layer_cache[slot_mapping // block_size, 0, 0, slot_mapping % block_size] = latent.to(
        layer_cache.dtype
    )


def gather_latent(
    layer_cache: torch.Tensor,  # [N, 1, 1, B, D]
    block_table: torch.Tensor,  # [max_blocks] int
    context_len: int,
    latent_dim: int | None = None,  # fp8_ds_mla caches: kv_lora_rank
    dtype: torch.dtype = torch.float32,  # fp8_ds_mla caches: dequantized into this
) -> torch.Tensor:  # [context_len, latent_dim + rope] (other caches: in the cache dtype)
    """The cached latent rows of positions ``0 .. context_len - 1`` of one sequence."""
    k, _ = reference.gather_kv(as_kv(layer_cache), block_table, context_len)
    if fp8_ds_mla.is_ds_mla(layer_cache.dtype):
        return fp8_ds_mla.dequantize_rows(k[0], _need_latent_dim(latent_dim), dtype)
    return k[0]


def dequantized_blocks(
    layer_cache: torch.Tensor,  # [N, 1, 1, B, record] uint8
    context_lens: torch.Tensor,  # [S] int
    block_tables: torch.Tensor,  # [S, max_blocks] int
    latent_dim: int,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:  # cache [S * n, 1, 1, B, D], tables [S, n]
    """The blocks the sequences read, dequantized into a dense latent cache of their own
    (block ``s * n + j`` is sequence s's j-th block) and the block tables into it."""
    block_size = layer_cache.shape[3]
    num_seqs = block_tables.shape[0]
    n = max(1, int((int(context_lens.max()) + block_size - 1) // block_size))
    records = layer_cache[block_tables[:, :n].long().flatten()]  # [S * n, 1, 1, B, record]
    dense = fp8_ds_mla.dequantize_rows(records, latent_dim, dtype)  # [S * n, 1, 1, B, D]
    tables = torch.arange(num_seqs * n, device=layer_cache.device).view(num_seqs, n)
    return dense, tables


def mla_decode_attention(
    q: torch.Tensor,  # [S, H, D]: absorbed queries (q_nope @ W_UK, then the rotated q_rope)
    layer_cache: torch.Tensor,  # [N, 1, 1, B, D] (fp8_ds_mla: [N, 1, 1, B, record] uint8)
    context_lens: torch.Tensor,  # [S] int, incl. the token being decoded
    block_tables: torch.Tensor,  # [S, max_blocks] int
    scale: float,
    latent_dim: int,  # kv_lora_rank: the values' width
    num_splits: int | None = None,  # the Triton kernel's split; one softmax here
) -> torch.Tensor:  # [S, H, latent_dim]
    if q.shape[0] and fp8_ds_mla.is_ds_mla(layer_cache.dtype):
        layer_cache, block_tables = dequantized_blocks(
            layer_cache, context_lens, block_tables, latent_dim, q.dtype
        )
    out = reference.decode_attention(q, as_kv(layer_cache), context_lens, block_tables, scale)
    return out[..., :latent_dim]
