"""Torch reference kernels for the paged KV cache (used on CPU; the oracle for Triton).

Cache layout of one rank (see common/engine/kv_layout.py): ``[num_blocks, num_layers, 2, H_kv,
block_size, D]`` -- block-major across layers, heads-major (HND) inside a block. The
kernels receive one layer's view ``layer_cache = cache[:, layer]`` of shape
``[num_blocks, 2, H_kv, block_size, D]`` (index 0 of dim 1 is K, 1 is V), a strided view.

Positions: a slot is ``block_id * block_size + offset``. The query tokens of sequence s
are its last ``q_len`` positions, ``context_len - q_len .. context_len - 1``; each attends
causally to every cached position up to its own (bounded by ``sliding_window`` if set:
key position k is visible to query position p iff ``p - sliding_window < k <= p``).

fp8 caches (float8_e4m3fn, ``--kv-cache-dtype fp8``): ``write_kv`` quantizes K and V with
their per-tensor scales, the attention functions dequantize what they read into q's dtype
and compute in it (kernels/fp8.py). Other caches: q is cast to the cache dtype, as before.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pdserve.kernels.fp8 import dequantize, is_fp8, quantize


def write_kv(
    layer_cache: torch.Tensor,  # [N, 2, H_kv, B, D]
    k: torch.Tensor,  # [T, H_kv, D]
    v: torch.Tensor,  # [T, H_kv, D]
    slot_mapping: torch.Tensor,  # [T] int64, block_id * B + offset
    k_scale: float = 1.0,  # fp8 caches: stored = k / k_scale
    v_scale: float = 1.0,
) -> None:
    block_size = layer_cache.shape[3]
    if bool((slot_mapping < 0).any()):  # negative slots mark padding: nothing to write
        keep = slot_mapping >= 0
        slot_mapping, k, v = slot_mapping[keep], k[keep], v[keep]
    blocks = slot_mapping // block_size
    offsets = slot_mapping % block_size
    # Advanced indices around a slice put the indexed dims first: [T, H_kv, D].
    if is_fp8(layer_cache.dtype):
        k, v = quantize(k, k_scale), quantize(v, v_scale)
    layer_cache[blocks, 0, :, offsets] = k.to(layer_cache.dtype)
    layer_cache[blocks, 1, :, offsets] = v.to(layer_cache.dtype)


def _dequantize_kv(
    blocks: torch.Tensor,  # [..., 2, H_kv, B, D]: K and V along kv_dim
    kv_dim: int,
    k_scale: float,
    v_scale: float,
    dtype: torch.dtype,
) -> torch.Tensor:
    """Gathered blocks of an fp8 cache as ``dtype`` (K and V each times its scale); blocks of
    any other cache as they are."""
    if not is_fp8(blocks.dtype):
        return blocks
    k, v = blocks.unbind(kv_dim)
    return torch.stack((dequantize(k, k_scale, dtype), dequantize(v, v_scale, dtype)), kv_dim)


def gather_kv(
    layer_cache: torch.Tensor,  # [N, 2, H_kv, B, D]
    block_table: torch.Tensor,  # [max_blocks] int
    context_len: int,
    first_block: int = 0,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    dtype: torch.dtype | None = None,  # fp8 caches: dequantized into this (default fp32)
) -> tuple[torch.Tensor, torch.Tensor]:
    """The cached K and V of positions ``first_block * B .. context_len - 1`` of one
    sequence, each [H_kv, n, D]."""
    block_size = layer_cache.shape[3]
    num_blocks = (context_len + block_size - 1) // block_size
    blocks = layer_cache[block_table[first_block:num_blocks].long()]  # [n, 2, H_kv, B, D]
    blocks = _dequantize_kv(blocks, 1, k_scale, v_scale, dtype or torch.float32)
    kv = blocks.permute(1, 2, 0, 3, 4).flatten(2, 3)  # [2, H_kv, n*B, D]
    num = context_len - first_block * block_size
    return kv[0, :, :num], kv[1, :, :num]


def _attend(
    q: torch.Tensor,  # [q_len, H_q, D]
    k: torch.Tensor,  # [H_kv, ctx, D]
    v: torch.Tensor,  # [H_kv, ctx, D]
    scale: float,
    sliding_window: int | None,
    first_pos: int = 0,  # the position of k[:, 0]
) -> torch.Tensor:  # [q_len, H_q, D]
    """One sequence's queries over its keys, on 4-D tensors: SDPA's fused CPU kernel takes
    only those (3-D ran the math path, a [H, q_len, ctx] score tensor materialised; 2.7x
    slower at 512 tokens). A whole prompt without a window is plain causal attention and
    needs no mask at all; a chunk after cached tokens or a window gets the boolean mask."""
    q_len, num_heads, _ = q.shape
    ctx = first_pos + k.shape[1]
    group = num_heads // k.shape[0]
    k = k.repeat_interleave(group, dim=0)[None]
    v = v.repeat_interleave(group, dim=0)[None]
    q4 = q.transpose(0, 1).to(k.dtype)[None]  # [1, H_q, q_len, D]
    if sliding_window is None and first_pos == 0 and q_len == ctx:
        out = F.scaled_dot_product_attention(q4, k, v, is_causal=True, scale=scale)
    else:
        q_pos = torch.arange(ctx - q_len, ctx, device=q.device)[:, None]  # [q_len, 1]
        k_pos = torch.arange(first_pos, ctx, device=q.device)[None, :]  # [1, n]
        visible = k_pos <= q_pos
        if sliding_window is not None:
            visible &= k_pos > q_pos - sliding_window
        out = F.scaled_dot_product_attention(q4, k, v, attn_mask=visible, scale=scale)
    return out[0].transpose(0, 1).to(q.dtype)  # [q_len, H_q, D]


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
) -> torch.Tensor:  # [T, H_q, D]
    out = torch.empty_like(q)
    starts = cu_seqlens_q.tolist()
    ctx_lens = context_lens.tolist()
    block_size = layer_cache.shape[3]
    for s, ctx in enumerate(ctx_lens):
        lo, hi = starts[s], starts[s + 1]
        # A window starts reading at the block of its first query's first key: blocks
        # before it may have gone back to the pool (common/engine/kv_groups.py).
        first_key = 0 if sliding_window is None else max(ctx - (hi - lo) - sliding_window + 1, 0)
        first_block = first_key // block_size
        k, v = gather_kv(layer_cache, block_tables[s], ctx, first_block, k_scale, v_scale, q.dtype)
        out[lo:hi] = _attend(q[lo:hi], k, v, scale, sliding_window, first_block * block_size)
    return out


def decode_attention(
    q: torch.Tensor,  # [S, H_q, D], one query token per sequence
    layer_cache: torch.Tensor,  # [N, 2, H_kv, B, D]
    context_lens: torch.Tensor,  # [S] int, incl. the token being decoded
    block_tables: torch.Tensor,  # [S, max_blocks] int
    scale: float,
    sliding_window: int | None = None,
    num_splits: int | None = None,  # the Triton kernel's flash-decoding split; one softmax here
    k_scale: float = 1.0,  # fp8 caches: K = stored * k_scale
    v_scale: float = 1.0,
) -> torch.Tensor:  # [S, H_q, D]
    """All sequences in one padded SDPA call: a per-sequence loop costs more than the
    padding at decode sizes.

    What a step reads is gathered once, straight into [2, H_kv, S, ctx, D] (index_select
    on the block dim of a permuted view: no copy after it); the grouped query heads of a
    KV head ride as SDPA's query rows ([S, H_kv, group, D]), so K/V are never repeated per
    query head; only the slots that some sequence must not see are zeroed, in place.
    """
    num_seqs, num_heads, head_dim = q.shape
    if num_seqs == 0:
        return torch.empty_like(q)
    _, _, num_kv_heads, block_size, _ = layer_cache.shape
    lens = context_lens.tolist()
    num_blocks = (max(lens) + block_size - 1) // block_size
    ctx = num_blocks * block_size
    # Blocks behind a window may be NULL_BLOCK (-1, common/engine/kv_groups.py): read block
    # 0 there, a slot no query sees.
    table = block_tables[:, :num_blocks].long().flatten().clamp(min=0)
    # index_select copies whole [B, D] runs; the result is [2, H_kv, S * n, B, D].
    kv = layer_cache.permute(1, 2, 0, 3, 4).index_select(2, table)
    kv = _dequantize_kv(kv, 0, k_scale, v_scale, q.dtype).reshape(
        2, num_kv_heads, num_seqs * ctx, head_dim
    )
    k_pos = torch.arange(ctx, device=q.device)[None, :]  # [1, ctx]
    q_pos = (context_lens.long() - 1)[:, None]  # [S, 1]
    visible = k_pos <= q_pos
    if sliding_window is not None:
        visible &= k_pos > q_pos - sliding_window
    # Slots a sequence must not see hold whatever was there (NaN in tests): zero them, since
    # a masked NaN still poisons SDPA's sums. Only those rows are written.
    hidden = (~visible).flatten().nonzero().squeeze(1)
    if hidden.numel():
        kv.index_fill_(2, hidden, 0)
    kv = kv.reshape(2, num_kv_heads, num_seqs, ctx, head_dim)
    group = num_heads // num_kv_heads
    k = kv[0].transpose(0, 1)  # [S, H_kv, ctx, D], strided views
    v = kv[1].transpose(0, 1)
    qg = q.reshape(num_seqs, num_kv_heads, group, head_dim).to(k.dtype)
    out = F.scaled_dot_product_attention(
        qg, k, v, attn_mask=visible[:, None, None, :], scale=scale
    )  # [S, H_kv, group, D]
    return out.reshape(num_seqs, num_heads, head_dim).to(q.dtype)
