"""The fp8_ds_mla record (common/engine/kv_quant.py): size, layout and round-trip error."""

from __future__ import annotations

import pytest
import torch

from pdserve.common.engine.kv_quant import (
    dequantize_ds_mla,
    ds_mla_record_bytes,
    quantize_ds_mla,
)


def test_record_is_656_bytes_a_token() -> None:
    assert ds_mla_record_bytes() == 656 == 512 + 4 * 4 + 64 * 2
    assert ds_mla_record_bytes(256, 32) == 256 + 8 + 64
    with pytest.raises(ValueError, match="multiple of 128"):
        ds_mla_record_bytes(500)


def test_round_trip_error_per_tile() -> None:
    gen = torch.Generator().manual_seed(0)
    # tiles of very different magnitudes, as a real latent has: each gets its own scale
    latent = torch.randn(33, 512, generator=gen) * torch.tensor(
        [0.01, 1.0, 30.0, 500.0]
    ).repeat_interleave(128)
    rope = torch.randn(33, 64, generator=gen) * 3
    record = quantize_ds_mla(latent, rope)
    assert record.dtype == torch.uint8 and tuple(record.shape) == (33, 656)
    back, rope_back = dequantize_ds_mla(record)
    scales = record[:, 512:528].contiguous().view(torch.float32)  # [T, 4]
    assert torch.allclose(scales, latent.reshape(33, 4, 128).abs().amax(-1) / 448)
    scale_of = scales.repeat_interleave(128, dim=1)  # [T, 512]
    # e4m3: half a step is 2^-4 of a normal value (|x| / scale >= 2^-6), 2^-10 scale below
    err = (back - latent).abs()
    assert (err <= latent.abs() * 2**-4 + 2**-10 * scale_of).all()
    # per (token, tile): ||error|| / ||tile||; measured max 0.0310, mean 0.0258 (e4m3's 3
    # mantissa bits; the same for every magnitude, since each tile has its own scale)
    tile_err = err.reshape(33, 4, 128).norm(dim=-1) / latent.reshape(33, 4, 128).norm(dim=-1)
    print(f"tile relative error max {tile_err.max():.4f} mean {tile_err.mean():.4f}")
    assert tile_err.max().item() < 0.045 and tile_err.mean().item() < 0.03
    # the largest value of each tile is exact: it maps to 448 = an fp8 value
    amax_at = latent.reshape(33, 4, 128).abs().argmax(-1, keepdim=True)
    assert torch.allclose(
        back.reshape(33, 4, 128).gather(-1, amax_at), latent.reshape(33, 4, 128).gather(-1, amax_at)
    )
    assert torch.equal(rope_back, rope.to(torch.bfloat16).float())  # rope kept in bf16


def test_zero_tile_and_records_are_bytes() -> None:
    latent = torch.zeros(2, 512)
    latent[1, 200] = -3.0
    record = quantize_ds_mla(latent.bfloat16(), torch.zeros(2, 64))
    back, _ = dequantize_ds_mla(record.clone(), dtype=torch.bfloat16)
    assert back.dtype == torch.bfloat16 and not back.isnan().any()
    assert torch.equal(back.float(), latent)
    with pytest.raises(ValueError, match="not fp8_ds_mla records"):
        dequantize_ds_mla(record.float())
