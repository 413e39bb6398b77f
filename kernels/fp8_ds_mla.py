"""vLLM's ``fp8_ds_mla`` record of an MLA latent token (torch; the Triton kernels in
kernels/triton_mla.py write and read the same bytes).

DeepSeek-V3 (kv_lora_rank 512, rope 64): each token of each layer is one uint8 record of
``record_bytes()`` = 656 bytes,

    [0, 512)    the latent in float8_e4m3fn, tile t = values [128 t, 128 t + 128)
    [512, 528)  4 float32 scales, one per tile: scale = max(|tile|) / 448 (never 0)
    [528, 656)  the 64 rope values in bfloat16, unquantized

so the latent dequantizes as ``fp8 * scale`` of its tile. The scales live in the record,
so a transfer that moves the records moves their scales with them. A cache in this format
is a uint8 tensor whose last dimension is the record (``is_ds_mla``).

DeepSeek-V3.2 appends its lightning indexer's key in vLLM's fp8 form of it (vLLM's
``indexer_k_quant_and_cache``): the key in float8_e4m3fn, then one float32 scale per 128
values, the scale a power of two (``ue8m0``: 2^ceil(log2(max(|tile|, 1e-4) / 448))). V3.2's
128-value key makes 132 bytes, the record 656 + 132 = 788 (``quantize_indexed``).
"""

from __future__ import annotations

import torch

from pdserve.kernels.fp8 import FP8_DTYPE, FP8_MAX

KV_LORA_RANK = 512
ROPE_DIM = 64
TILE = 128  # latent values per fp32 scale
KEY_TILE = 128  # indexer key values per fp32 scale (vLLM's quant_block_size)
KEY_MIN_AMAX = 1e-4  # vLLM's floor of a key tile's max before its scale is taken
MIN_SCALE = torch.finfo(torch.float32).tiny  # an all-zero tile keeps a finite, nonzero scale


def is_ds_mla(dtype: torch.dtype) -> bool:
    """A latent cache of this dtype holds fp8_ds_mla records (uint8 bytes)."""
    return dtype == torch.uint8


def check_rank(kv_lora_rank: int) -> None:
    if kv_lora_rank < TILE or kv_lora_rank % TILE:
        raise ValueError(
            f"fp8_ds_mla needs kv_lora_rank to be a multiple of {TILE}, got {kv_lora_rank}"
        )


def record_bytes(kv_lora_rank: int = KV_LORA_RANK, rope_dim: int = ROPE_DIM) -> int:
    """Bytes of one token's record: 656 for DeepSeek-V3's 512 + 64."""
    check_rank(kv_lora_rank)
    return kv_lora_rank + 4 * (kv_lora_rank // TILE) + 2 * rope_dim


def quantize(
    latent: torch.Tensor,  # [T, kv_lora_rank], any float dtype
    rope: torch.Tensor,  # [T, rope_dim]
) -> torch.Tensor:  # [T, record_bytes] uint8
    num_tokens, rank = latent.shape
    check_rank(rank)
    if rope.dim() != 2 or rope.shape[0] != num_tokens:
        raise ValueError(f"rope must be [{num_tokens}, rope_dim], got {tuple(rope.shape)}")
    tiles = latent.float().reshape(num_tokens, rank // TILE, TILE)  # [T, n, 128]
    scales = (tiles.abs().amax(-1) / FP8_MAX).clamp_min(MIN_SCALE)  # [T, n] fp32
    values = (tiles / scales[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    record = torch.empty(
        num_tokens, record_bytes(rank, rope.shape[1]), dtype=torch.uint8, device=latent.device
    )
    scale_end = rank + 4 * scales.shape[1]
    record[:, :rank] = values.reshape(num_tokens, rank).view(torch.uint8)
    record[:, rank:scale_end] = scales.contiguous().view(torch.uint8)
    record[:, scale_end:] = rope.to(torch.bfloat16).contiguous().view(torch.uint8)
    return record


def dequantize(
    record: torch.Tensor,  # [..., record_bytes] uint8
    kv_lora_rank: int = KV_LORA_RANK,
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:  # latent [..., kv_lora_rank], rope [..., rope_dim]
    check_rank(kv_lora_rank)
    num_tiles = kv_lora_rank // TILE
    scale_end = kv_lora_rank + 4 * num_tiles
    rope_bytes = record.shape[-1] - scale_end
    if record.dtype != torch.uint8 or rope_bytes <= 0 or rope_bytes % 2:
        raise ValueError(
            f"not fp8_ds_mla records of kv_lora_rank {kv_lora_rank}: "
            f"{record.dtype} {tuple(record.shape)}"
        )
    lead = record.shape[:-1]
    flat = record.reshape(-1, record.shape[-1])
    values = flat[:, :kv_lora_rank].contiguous().view(FP8_DTYPE).float()
    scales = flat[:, kv_lora_rank:scale_end].contiguous().view(torch.float32)  # [T, n]
    latent = values.reshape(-1, num_tiles, TILE) * scales[..., None]
    rope = flat[:, scale_end:].contiguous().view(torch.bfloat16)
    return (
        latent.reshape(*lead, kv_lora_rank).to(dtype),
        rope.reshape(*lead, rope_bytes // 2).to(dtype),
    )


def dequantize_rows(
    record: torch.Tensor,  # [..., record_bytes] uint8
    kv_lora_rank: int,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:  # [..., kv_lora_rank + rope_dim]: latent ++ rope, as an auto cache holds
    latent, rope = dequantize(record, kv_lora_rank, dtype)
    return torch.cat((latent, rope), dim=-1)


def key_bytes(index_dim: int) -> int:
    """Bytes of one indexer key in fp8: 132 for V3.2's 128 values."""
    if index_dim < KEY_TILE or index_dim % KEY_TILE:
        raise ValueError(
            f"the fp8 indexer key needs index_head_dim to be a multiple of {KEY_TILE}, "
            f"got {index_dim}"
        )
    return index_dim + 4 * (index_dim // KEY_TILE)


def quantize_keys(keys: torch.Tensor) -> torch.Tensor:  # [T, index_dim] -> [T, key_bytes] uint8
    num_tokens, dim = keys.shape
    num_tiles = (key_bytes(dim) - dim) // 4
    tiles = keys.float().reshape(num_tokens, num_tiles, KEY_TILE)
    # ue8m0: the scale rounded up to a power of two, so x / scale is exact before the cast
    scales = torch.exp2(
        torch.ceil(torch.log2(tiles.abs().amax(-1).clamp_min(KEY_MIN_AMAX) / FP8_MAX))
    )
    values = (tiles / scales[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    out = torch.empty(num_tokens, key_bytes(dim), dtype=torch.uint8, device=keys.device)
    out[:, :dim] = values.reshape(num_tokens, dim).view(torch.uint8)
    out[:, dim:] = scales.contiguous().view(torch.uint8)
    return out


def dequantize_keys(
    raw: torch.Tensor,  # [..., key_bytes] uint8
    index_dim: int,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:  # [..., index_dim]
    if raw.dtype != torch.uint8 or raw.shape[-1] != key_bytes(index_dim):
        raise ValueError(
            f"not fp8 indexer keys of {index_dim} values: {raw.dtype} {tuple(raw.shape)}"
        )
    lead = raw.shape[:-1]
    flat = raw.reshape(-1, raw.shape[-1])
    values = flat[:, :index_dim].contiguous().view(FP8_DTYPE).float()
    scales = (
        flat[:, index_dim:].clone(memory_format=torch.contiguous_format).view(torch.float32)
    )  # [T, tiles]
    keys = values.reshape(flat.shape[0], index_dim // KEY_TILE, KEY_TILE) * scales[..., None]
    return keys.reshape(*lead, index_dim).to(dtype)


def quantize_indexed(
    latent: torch.Tensor,  # [T, kv_lora_rank]
    rope: torch.Tensor,  # [T, rope_dim]
    keys: torch.Tensor,  # [T, index_dim]: the indexer's key
) -> torch.Tensor:  # [T, record_bytes + key_bytes] uint8
    """DeepSeek-V3.2's row: the fp8_ds_mla record, then the indexer key's fp8 form."""
    return torch.cat((quantize(latent, rope), quantize_keys(keys)), dim=-1)


def dequantize_indexed(
    record: torch.Tensor,  # [..., record_bytes + key_bytes] uint8
    kv_lora_rank: int,
    index_dim: int,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:  # [..., kv_lora_rank + rope_dim + index_dim]: as an auto cache's row
    cut = record.shape[-1] - key_bytes(index_dim)
    rows = dequantize_rows(record[..., :cut], kv_lora_rank, dtype)
    return torch.cat((rows, dequantize_keys(record[..., cut:], index_dim, dtype)), dim=-1)
