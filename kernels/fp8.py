"""fp8 (float8 e4m3fn) KV storage: quantize on write, dequantize on read, one scale per tensor.

``stored = clamp(value * (1 / scale), -448, 448)`` rounded to nearest even, and ``value =
stored * scale`` in fp32, then cast to the compute dtype. Both steps are one fp32 multiply,
so the Triton kernels (``kernels/triton_common.py``) round exactly as these functions do.
e4m3fn has no infinity: without the clamp an out-of-range value would become NaN.
"""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype == FP8_DTYPE


def quantize(x: torch.Tensor, scale: float) -> torch.Tensor:
    """x (any float dtype) -> float8_e4m3fn of x / scale, saturated."""
    return (x.float() * (1.0 / scale)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def dequantize(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """float8_e4m3fn -> ``dtype`` of x * scale (the product in fp32)."""
    return (x.float() * scale).to(dtype)
