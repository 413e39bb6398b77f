"""vLLM's fp8 form of a DeepSeek-V4 K=V row, and pdserve's fp8 cache rows built on it
(torch; no Triton kernel writes or reads them yet).

A V4 K=V row (``head_dim`` values, the rotated ``rope_dim`` last) is stored as vLLM's
``quantize_and_insert_k_cache`` stores it (V4-Flash: 448 + 64 -> 584 bytes):

    [0, nope)                  the nope values in float8_e4m3fn, tile t = values [64 t, 64 t + 64)
    [nope, nope + 2 rope)      the rope values in bfloat16, unquantized
    [.., + nope / 64)          one ue8m0 scale byte per tile: the exponent e + 127 of the
                               tile's scale 2^e = 2^ceil(log2(max(|tile|, 1e-4) / 448))
    [.., + 1)                  a pad byte, 0

so a value dequantizes as ``fp8 * 2^(byte - 127)``. Reads copy a section before viewing its
bytes as a wider dtype (``clone``): a row's section may start at an odd byte. vLLM groups a block's rows: the B
tokens' 576 data bytes, then their B x 8 scale bytes; here each row's scale bytes follow its
data (docs/models.md). The lightning indexer's key of a CSA entry takes V3.2's fp8 form
(kernels/fp8_ds_mla.py ``quantize_keys``: 128 fp8 values, one float32 ue8m0 scale).

pdserve's rows (common/model/deepseek/dsv4_attention.py): a per-token row is the K=V record, then the
compressors' per-token kv and gate projections in the model's dtype, unquantized (vLLM keeps
its compressor state unquantized too, in float32, with the position bias already added, in
a cache of its own); an entry is the K=V record, then (CSA) the indexer key's fp8 form.
Every row is zero-padded to the cache's width (one width for every group).
"""

from __future__ import annotations

import torch

from pdserve.kernels import fp8_ds_mla
from pdserve.kernels.fp8 import FP8_DTYPE, FP8_MAX

TILE = 64  # nope values per ue8m0 scale byte
MIN_AMAX = 1e-4  # vLLM's floor of a tile's max before its scale is taken
EXPONENT_BIAS = 127


def check_dims(head_dim: int, rope_dim: int) -> None:
    nope = head_dim - rope_dim
    if nope < TILE or nope % TILE:
        raise ValueError(
            f"the fp8 DeepSeek-V4 row needs head_dim - rope_dim to be a multiple of {TILE}, "
            f"the model's is {head_dim} - {rope_dim} = {nope}"
        )


def kv_bytes(head_dim: int, rope_dim: int) -> int:
    """Bytes of one K=V record: 584 for V4-Flash's 512 with rope 64."""
    check_dims(head_dim, rope_dim)
    nope = head_dim - rope_dim
    return nope + 2 * rope_dim + nope // TILE + 1


def quantize_kv(kv: torch.Tensor, rope_dim: int) -> torch.Tensor:
    """[T, head_dim] (rope last) -> [T, kv_bytes] uint8."""
    num_tokens, head_dim = kv.shape
    nope = head_dim - rope_dim
    num_tiles = nope // TILE
    record = torch.zeros(
        num_tokens, kv_bytes(head_dim, rope_dim), dtype=torch.uint8, device=kv.device
    )
    tiles = kv[:, :nope].float().reshape(num_tokens, num_tiles, TILE)
    exponents = torch.ceil(torch.log2(tiles.abs().amax(-1).clamp_min(MIN_AMAX) / FP8_MAX))
    values = (tiles / torch.exp2(exponents)[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    record[:, :nope] = values.reshape(num_tokens, nope).view(torch.uint8)
    scales_at = nope + 2 * rope_dim
    record[:, nope:scales_at] = kv[:, nope:].to(torch.bfloat16).contiguous().view(torch.uint8)
    biased = (exponents + EXPONENT_BIAS).clamp(0, 255)
    record[:, scales_at : scales_at + num_tiles] = biased.to(torch.uint8)
    return record


def dequantize_kv(
    record: torch.Tensor,  # [..., kv_bytes] uint8
    head_dim: int,
    rope_dim: int,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:  # [..., head_dim]
    if record.dtype != torch.uint8 or record.shape[-1] != kv_bytes(head_dim, rope_dim):
        raise ValueError(
            f"not fp8 DeepSeek-V4 rows of head_dim {head_dim}: {record.dtype} {tuple(record.shape)}"
        )
    nope = head_dim - rope_dim
    lead = record.shape[:-1]
    flat = record.reshape(-1, record.shape[-1])
    values = flat[:, :nope].contiguous().view(FP8_DTYPE).float()
    scales_at = nope + 2 * rope_dim
    rope = (
        flat[:, nope:scales_at]
        .clone(memory_format=torch.contiguous_format)
        .view(torch.bfloat16)
        .float()
    )
    biased = flat[:, scales_at : scales_at + nope // TILE].float()
    scales = torch.exp2(biased - EXPONENT_BIAS)  # [T, tiles]
    nope_values = values.reshape(flat.shape[0], nope // TILE, TILE) * scales[..., None]
    return torch.cat((nope_values.flatten(1), rope), dim=-1).reshape(*lead, head_dim).to(dtype)


def _padded(parts: list[torch.Tensor], width: int) -> torch.Tensor:
    row = torch.cat(parts, dim=-1)
    if row.shape[-1] > width:
        raise ValueError(f"an fp8 DeepSeek-V4 row of {row.shape[-1]} bytes in a {width}-byte page")
    return torch.nn.functional.pad(row, (0, width - row.shape[-1]))


def pack_rows(
    rows: torch.Tensor,  # [T, head_dim + S]: K=V, then the compressors' projections
    head_dim: int,
    rope_dim: int,
    width: int,  # the cache's bytes a slot
) -> torch.Tensor:  # [T, width] uint8
    """A per-token row: the K=V record, then the projections' bytes in their own dtype."""
    kv, state = rows[:, :head_dim], rows[:, head_dim:]
    state_bytes = state.contiguous().view(torch.uint8).reshape(rows.shape[0], -1)
    return _padded([quantize_kv(kv, rope_dim), state_bytes], width)


def unpack_rows(
    raw: torch.Tensor,  # [n, width] uint8
    head_dim: int,
    rope_dim: int,
    dtype: torch.dtype,  # the projections' dtype (the model's) and the result's
) -> torch.Tensor:  # [n, head_dim + S]: as the auto cache's row (S: as many as fit)
    cut = kv_bytes(head_dim, rope_dim)
    size = torch.finfo(dtype).bits // 8
    end = cut + (raw.shape[-1] - cut) // size * size
    state = raw[:, cut:end].clone(memory_format=torch.contiguous_format).view(dtype)
    return torch.cat((dequantize_kv(raw[:, :cut], head_dim, rope_dim, dtype), state), dim=-1)


def pack_entries(
    entries: torch.Tensor,  # [T, head_dim (+ index_dim)]: K=V, then CSA's indexer key
    head_dim: int,
    rope_dim: int,
    width: int,
) -> torch.Tensor:  # [T, width] uint8
    parts = [quantize_kv(entries[:, :head_dim], rope_dim)]
    if entries.shape[-1] > head_dim:
        parts.append(fp8_ds_mla.quantize_keys(entries[:, head_dim:]))
    return _padded(parts, width)


def unpack_entries(
    raw: torch.Tensor,  # [n, width] uint8
    head_dim: int,
    rope_dim: int,
    index_dim: int,  # 0: no indexer key (HCA)
    dtype: torch.dtype,
) -> torch.Tensor:  # [n, head_dim (+ index_dim)]
    cut = kv_bytes(head_dim, rope_dim)
    kv = dequantize_kv(raw[:, :cut], head_dim, rope_dim, dtype)
    if not index_dim:
        return kv
    key = raw[:, cut : cut + fp8_ds_mla.key_bytes(index_dim)]
    return torch.cat((kv, fp8_ds_mla.dequantize_keys(key, index_dim, dtype)), dim=-1)


def is_fp8(dtype: torch.dtype) -> bool:
    """A V4 cache of this dtype holds the fp8 rows (uint8 bytes)."""
    return dtype == torch.uint8
