"""Triton pieces for an MLA latent cache of fp8_ds_mla records (``--kv-cache-dtype fp8``):
the write that quantizes each token's latent row into its 656-byte record, and the loads
the decode kernel (kernels/triton_mla.py) dequantizes the records with.

One record (kernels/fp8_ds_mla.py): LATENT fp8 e4m3 values, LATENT / TILE fp32 scales (one
per TILE = 128 latent values), ROPE bf16 values; the cache is uint8, so pointers into it
count bytes and are cast to the section's type. The write rounds as the torch reference:
``scale = max(|tile|) / 448`` (at least the smallest normal fp32), ``value / scale`` as
IEEE divisions (``tl.div_rn``), saturated to +-448, rounded to nearest even into fp8; the
rope part to bf16 to nearest even. So both write the same bytes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.kernels import fp8_ds_mla
from pdserve.kernels.fp8 import FP8_MAX
from pdserve.kernels.triton_common import _device_guard, _is_pow2


@triton.jit
def _write_ds_mla_kernel(
    cache_ptr,  # [N, 1, 1, B, RECORD] uint8
    row_ptr,  # [T, LATENT + ROPE] in the model's dtype
    slot_ptr,  # [T]
    stride_cn,
    stride_cb,
    stride_rt,
    stride_rd,
    LATENT: tl.constexpr,
    ROPE: tl.constexpr,
    TILE: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    FP8_LIMIT: tl.constexpr,
    MIN_SCALE: tl.constexpr,
):
    # One program per token: quantizes one latent row into its record; negative slots
    # (padding) are skipped.
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:
        dst = cache_ptr + (slot // BLOCK_SIZE) * stride_cn + (slot % BLOCK_SIZE) * stride_cb
        src = row_ptr + t * stride_rt
        d = tl.arange(0, TILE)
        scale_ptr = (dst + LATENT).to(tl.pointer_type(tl.float32))
        for tile in tl.static_range(LATENT // TILE):
            x = tl.load(src + (tile * TILE + d) * stride_rd).to(tl.float32)  # [TILE]
            scale = tl.maximum(tl.div_rn(tl.max(tl.abs(x), 0), FP8_LIMIT), MIN_SCALE)
            q = tl.minimum(tl.maximum(tl.div_rn(x, scale), -FP8_LIMIT), FP8_LIMIT)
            q = q.to(tl.float8e4nv, fp_downcast_rounding="rtne")
            tl.store(dst + tile * TILE + d, q.to(tl.uint8, bitcast=True))
            tl.store(scale_ptr + tile, scale)
        r = tl.arange(0, ROPE)
        rope = tl.load(src + (LATENT + r) * stride_rd).to(tl.float32).to(tl.bfloat16)
        rope_ptr = (dst + LATENT + 4 * (LATENT // TILE)).to(tl.pointer_type(tl.bfloat16))
        tl.store(rope_ptr + r, rope)


@triton.jit
def load_ds_mla(
    rows,  # [N] uint8 pointers: each key's record
    k_ok,  # [N] the key exists (the rest are not loaded: 0)
    LATENT: tl.constexpr,
    ROPE: tl.constexpr,
    TILE: tl.constexpr,
    DTYPE: tl.constexpr,
):
    """(latent [N, LATENT], rope [N, ROPE]) of the records, dequantized into DTYPE.

    Each record's LATENT / TILE scales are loaded once, as an [N, LATENT / TILE] tile, and
    multiply the fp8 values seen as [N, LATENT / TILE, TILE] (each tile row its scale),
    which then are flattened back into [N, LATENT]: no load per value."""
    NT: tl.constexpr = LATENT // TILE
    t = tl.arange(0, NT)
    d = tl.arange(0, TILE)
    offs = (t[:, None] * TILE + d[None, :])[None, :, :]  # [1, NT, TILE]
    raw = tl.load(rows[:, None, None] + offs, mask=k_ok[:, None, None], other=0)  # uint8
    scale_ptrs = (rows + LATENT).to(tl.pointer_type(tl.float32))[:, None] + t[None, :]
    scales = tl.load(scale_ptrs, mask=k_ok[:, None], other=0.0)  # [N, NT]
    values = raw.to(tl.float8e4nv, bitcast=True).to(tl.float32) * scales[:, :, None]
    latent = tl.reshape(values.to(DTYPE), (values.shape[0], LATENT))
    dr = tl.arange(0, ROPE)
    rope_ptrs = (rows + LATENT + 4 * NT).to(tl.pointer_type(tl.bfloat16))
    rope = tl.load(rope_ptrs[:, None] + dr[None, :], mask=k_ok[:, None], other=0.0)
    return latent, rope.to(DTYPE)


def record_rope(layer_cache: torch.Tensor, latent_dim: int) -> int:
    """The rope width of a uint8 latent cache of fp8_ds_mla records of ``latent_dim``."""
    fp8_ds_mla.check_rank(latent_dim)
    rope_bytes = layer_cache.shape[-1] - latent_dim - 4 * (latent_dim // fp8_ds_mla.TILE)
    assert rope_bytes > 0 and rope_bytes % 2 == 0 and layer_cache.stride(-1) == 1, (
        f"not an fp8_ds_mla cache of kv_lora_rank {latent_dim}: {tuple(layer_cache.shape)}"
    )
    return rope_bytes // 2


def write_ds_mla(
    layer_cache: torch.Tensor,  # [N, 1, 1, B, RECORD] uint8
    latent: torch.Tensor,  # [T, latent_dim + rope]
    slot_mapping: torch.Tensor,  # [T] int64; negative: padding, skipped
    latent_dim: int,
    block_size: int,
) -> None:
    rope = record_rope(layer_cache, latent_dim)
    assert latent.dim() == 2 and latent.shape[1] == latent_dim + rope, (
        f"latent rows must be [T, {latent_dim + rope}], got {tuple(latent.shape)}"
    )
    assert _is_pow2(rope), f"the triton fp8_ds_mla write needs a power-of-two rope, got {rope}"
    if latent.shape[0] == 0:
        return
    stride_cn, _, _, stride_cb, _ = layer_cache.stride()
    with _device_guard(layer_cache):
        _write_ds_mla_kernel[(latent.shape[0],)](
            layer_cache,
            latent,
            slot_mapping.contiguous(),
            stride_cn,
            stride_cb,
            *latent.stride(),
            LATENT=latent_dim,
            ROPE=rope,
            TILE=fp8_ds_mla.TILE,
            BLOCK_SIZE=block_size,
            FP8_LIMIT=FP8_MAX,
            MIN_SCALE=fp8_ds_mla.MIN_SCALE,
        )
