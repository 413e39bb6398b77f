"""Torch reference kernels for an MLA latent cache (used on CPU; the oracle for Triton).

One layer's latent cache is the view ``[N, 1, 1, B, D]`` of ``[N, L, 1, 1, B, D]``
(common/engine/kv_layout.py with ``num_kv_parts = 1``): per token one row of D values,
the latent (its first ``latent_dim`` values, ``kv_lora_rank``) then the rotated key part
shared by all heads. In the absorbed form every query head attends this one row as its key
and its first ``latent_dim`` values as its value, i.e. multi-query attention with one KV
head of width D whose value is the key's prefix; the reference runs the GQA reference of
kernels/reference.py over a view that shows the row as both K and V.
"""

from __future__ import annotations

import torch

from pdserve.kernels import reference


def as_kv(layer_cache: torch.Tensor) -> torch.Tensor:
    """``[N, 1, 1, B, D]`` seen as ``[N, 2, 1, B, D]``: K and V both the latent row (stride 0)."""
    assert layer_cache.dim() == 5 and layer_cache.shape[1] == 1 and layer_cache.shape[2] == 1, (
        f"an MLA layer cache is [N, 1, 1, block_size, D], got {tuple(layer_cache.shape)}"
    )
    return layer_cache.expand(-1, 2, -1, -1, -1)


def write_latent(
    layer_cache: torch.Tensor,  # [N, 1, 1, B, D]
    latent: torch.Tensor,  # [T, D]
    slot_mapping: torch.Tensor,  # [T] int64, block_id * B + offset; negative: padding
) -> None:
    block_size = layer_cache.shape[3]
    keep = slot_mapping >= 0
    slot_mapping, latent = slot_mapping[keep], latent[keep]
    layer_cache[slot_mapping // block_size, 0, 0, slot_mapping % block_size] = latent.to(
        layer_cache.dtype
    )


def gather_latent(
    layer_cache: torch.Tensor,  # [N, 1, 1, B, D]
    block_table: torch.Tensor,  # [max_blocks] int
    context_len: int,
) -> torch.Tensor:  # [context_len, D]
    """The cached latent rows of positions ``0 .. context_len - 1`` of one sequence."""
    k, _ = reference.gather_kv(as_kv(layer_cache), block_table, context_len)
    return k[0]


def mla_decode_attention(
    q: torch.Tensor,  # [S, H, D]: absorbed queries (q_nope @ W_UK, then the rotated q_rope)
    layer_cache: torch.Tensor,  # [N, 1, 1, B, D]
    context_lens: torch.Tensor,  # [S] int, incl. the token being decoded
    block_tables: torch.Tensor,  # [S, max_blocks] int
    scale: float,
    latent_dim: int,  # kv_lora_rank: the values' width
    num_splits: int | None = None,  # the Triton kernel's split; one softmax here
) -> torch.Tensor:  # [S, H, latent_dim]
    out = reference.decode_attention(q, as_kv(layer_cache), context_lens, block_tables, scale)
    return out[..., :latent_dim]
