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
  ``dequantize_ds_mla`` convert a batch of tokens to and from records (kernels/fp8_ds_mla.py,
  which the latent cache's kernels use). The scales live in the record, so a pull that
  moves the records moves the scales with them.
"""

from __future__ import annotations

import torch

from pdserve.kernels import fp8_ds_mla
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

DS_MLA_KV_LORA_RANK = fp8_ds_mla.KV_LORA_RANK
DS_MLA_ROPE_DIM = fp8_ds_mla.ROPE_DIM
DS_MLA_TILE = fp8_ds_mla.TILE  # latent values per fp32 scale


def ds_mla_record_bytes(
    kv_lora_rank: int = DS_MLA_KV_LORA_RANK, rope_dim: int = DS_MLA_ROPE_DIM
) -> int:
    """Bytes of one token's record: 656 for DeepSeek-V3's 512 + 64."""
    return fp8_ds_mla.record_bytes(kv_lora_rank, rope_dim)


def quantize_ds_mla(
    latent: torch.Tensor,  # [T, kv_lora_rank], any float dtype
    rope: torch.Tensor,  # [T, rope_dim]
) -> torch.Tensor:  # [T, ds_mla_record_bytes] uint8
    return fp8_ds_mla.quantize(latent, rope)


def dequantize_ds_mla(
    record: torch.Tensor,  # [T, ds_mla_record_bytes] uint8
    kv_lora_rank: int = DS_MLA_KV_LORA_RANK,
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:  # latent [T, kv_lora_rank], rope [T, rope_dim]
    return fp8_ds_mla.dequantize(record, kv_lora_rank, dtype)
