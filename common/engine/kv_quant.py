"""KV quantization formats (pure torch), for the KV caches and their tests.

* Per-tensor fp8 for ordinary (GQA/MHA) caches: ``quantize_fp8`` / ``dequantize_fp8`` are the
  kernels' own rules (kernels/fp8.py): stored = clamp(x / scale, +-448) in float8_e4m3fn,
  one fp32 scale for every K (``KVLayout.k_scale``) and one for every V.
* vLLM's ``fp8_ds_mla`` record for an MLA latent cache (DeepSeek-V3: kv_lora_rank 512, rope
  64): each token is one uint8 record of ``ds_mla_record_bytes()`` = 656 bytes,

      [0, 512)    the latent in float8_e4m3fn, tile t = values [128 t, 128 t + 128)
      [512, 528)  4 float32 scales, one per tile: scale = max(|tile|) / 448 (never 0)
      [528, 656)  the 64 rope values in bfloat16, unquantized

  so the latent dequantizes as ``fp8 * scale`` of its tile. ``quantize_ds_mla`` /
  ``dequantize_ds_mla`` convert a batch of tokens to and from records. The scales live in
  the record, so a pull that moves the records moves the scales with them.
"""

from __future__ import annotations

import torch

from pdserve.kernels.fp8 import FP8_DTYPE, FP8_MAX
from pdserve.kernels.fp8 import dequantize as dequantize_fp8
from pdserve.kernels.fp8 import quantize as quantize_fp8

__all__ = [
    "DS_MLA_KV_LORA_RANK",
    "DS_MLA_ROPE_DIM",
    "DS_MLA_TILE",
    "dequantize_ds_mla",
    "dequantize_fp8",
    "ds_mla_record_bytes",
    "quantize_ds_mla",
    "quantize_fp8",
]

DS_MLA_KV_LORA_RANK = 512
DS_MLA_ROPE_DIM = 64
DS_MLA_TILE = 128  # latent values per fp32 scale
_MIN_SCALE = torch.finfo(torch.float32).tiny  # an all-zero tile keeps a finite, nonzero scale


def ds_mla_record_bytes(
    kv_lora_rank: int = DS_MLA_KV_LORA_RANK, rope_dim: int = DS_MLA_ROPE_DIM
) -> int:
    """Bytes of one token's record: 656 for DeepSeek-V3's 512 + 64."""
    _check_rank(kv_lora_rank)
    return kv_lora_rank + 4 * (kv_lora_rank // DS_MLA_TILE) + 2 * rope_dim


def _check_rank(kv_lora_rank: int) -> None:
    if kv_lora_rank < DS_MLA_TILE or kv_lora_rank % DS_MLA_TILE:
        raise ValueError(
            f"fp8_ds_mla needs kv_lora_rank to be a multiple of {DS_MLA_TILE}, got {kv_lora_rank}"
        )


def quantize_ds_mla(
    latent: torch.Tensor,  # [T, kv_lora_rank], any float dtype
    rope: torch.Tensor,  # [T, rope_dim]
) -> torch.Tensor:  # [T, ds_mla_record_bytes] uint8
    num_tokens, rank = latent.shape
    _check_rank(rank)
    if rope.dim() != 2 or rope.shape[0] != num_tokens:
        raise ValueError(f"rope must be [{num_tokens}, rope_dim], got {tuple(rope.shape)}")
    tiles = latent.float().reshape(num_tokens, rank // DS_MLA_TILE, DS_MLA_TILE)  # [T, n, 128]
    scales = (tiles.abs().amax(-1) / FP8_MAX).clamp_min(_MIN_SCALE)  # [T, n] fp32
    values = (tiles / scales[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    record = torch.empty(
        num_tokens,
        ds_mla_record_bytes(rank, rope.shape[1]),
        dtype=torch.uint8,
        device=latent.device,
    )
    scale_end = rank + 4 * scales.shape[1]
    record[:, :rank] = values.reshape(num_tokens, rank).view(torch.uint8)
    record[:, rank:scale_end] = scales.contiguous().view(torch.uint8)
    record[:, scale_end:] = rope.to(torch.bfloat16).contiguous().view(torch.uint8)
    return record


def dequantize_ds_mla(
    record: torch.Tensor,  # [T, ds_mla_record_bytes] uint8
    kv_lora_rank: int = DS_MLA_KV_LORA_RANK,
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:  # latent [T, kv_lora_rank], rope [T, rope_dim]
    _check_rank(kv_lora_rank)
    num_tiles = kv_lora_rank // DS_MLA_TILE
    scale_end = kv_lora_rank + 4 * num_tiles
    rope_bytes = record.shape[1] - scale_end
    if record.dtype != torch.uint8 or record.dim() != 2 or rope_bytes <= 0 or rope_bytes % 2:
        raise ValueError(
            f"not fp8_ds_mla records of kv_lora_rank {kv_lora_rank}: "
            f"{record.dtype} {tuple(record.shape)}"
        )
    num_tokens = record.shape[0]
    values = record[:, :kv_lora_rank].contiguous().view(FP8_DTYPE).float()
    scales = record[:, kv_lora_rank:scale_end].contiguous().view(torch.float32)  # [T, n]
    latent = values.reshape(num_tokens, num_tiles, DS_MLA_TILE) * scales[..., None]
    rope = record[:, scale_end:].contiguous().view(torch.bfloat16)
    return latent.reshape(num_tokens, kv_lora_rank).to(dtype), rope.to(dtype)
