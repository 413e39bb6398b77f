"""Rotary position embeddings with the scaling variants Llama-family configs use.

Frequencies follow Hugging Face's definitions (``rope_type`` default, linear, llama3,
yarn, dynamic) so that positions rotate exactly as the reference model rotates them.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from pdserve.common.errors import ModelLoadError


def inv_frequencies(
    head_dim: int, theta: float, scaling: dict[str, Any] | None, max_position: int
) -> tuple[torch.Tensor, float]:
    """Per-pair inverse frequencies [head_dim // 2] (float32) and the cos/sin scale."""
    base = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if not scaling:
        return base, 1.0
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    factor = float(scaling.get("factor", 1.0))
    if kind == "default":
        return base, 1.0
    if kind == "linear":
        return base / factor, 1.0
    if kind == "llama3":
        return _llama3(base, scaling), 1.0
    if kind == "yarn":
        return _yarn(head_dim, theta, scaling, max_position)
    if kind == "dynamic":
        # HF rescales the base by the longest position in each forward pass, which makes a
        # token's rotation depend on its batch neighbours. A server needs one answer per
        # position, so (as vLLM does) the base is fixed for the longest context served.
        original = scaling.get("original_max_position_embeddings", max_position)
        longest = original * factor
        theta = theta * ((factor * longest / original) - (factor - 1)) ** (
            head_dim / (head_dim - 2)
        )
        exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
        return 1.0 / (theta**exponents), 1.0
    raise ModelLoadError(f"rope scaling type {kind!r} is not supported")


def _llama3(base: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    factor = scaling["factor"]
    low_freq_factor = scaling["low_freq_factor"]
    high_freq_factor = scaling["high_freq_factor"]
    original = scaling["original_max_position_embeddings"]
    low_freq_wavelen = original / low_freq_factor
    high_freq_wavelen = original / high_freq_factor
    wavelen = 2 * math.pi / base
    scaled = torch.where(wavelen > low_freq_wavelen, base / factor, base)
    smooth = (original / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn(
    head_dim: int, theta: float, scaling: dict[str, Any], max_position: int
) -> tuple[torch.Tensor, float]:
    factor = scaling["factor"]
    original = scaling.get("original_max_position_embeddings") or max_position
    beta_fast = scaling.get("beta_fast") or 32
    beta_slow = scaling.get("beta_slow") or 1
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")

    def get_mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)
        else:
            attention_factor = get_mscale(factor)

    def correction_dim(num_rotations: float) -> float:
        return (head_dim * math.log(original / (num_rotations * 2 * math.pi))) / (
            2 * math.log(theta)
        )

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    ramp = (torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)
    extrapolation_weight = 1 - ramp.clamp(0, 1)
    pos_freqs = theta ** (torch.arange(0, head_dim, 2).to(dtype=torch.float) / head_dim)
    extrapolated = 1.0 / pos_freqs
    interpolated = 1.0 / (factor * pos_freqs)
    inv = interpolated * (1 - extrapolation_weight) + extrapolated * extrapolation_weight
    return inv, float(attention_factor)


class RotaryEmbedding(torch.nn.Module):
    """cos / sin of positions for HF's rotate_half layout (pairs i and i + D/2); the
    rotation itself is ``kernels.rotary``."""

    inv_freq: torch.Tensor  # [D/2], a buffer

    def __init__(
        self, head_dim: int, theta: float, scaling: dict[str, Any] | None, max_position: int
    ) -> None:
        super().__init__()
        # on CPU also inside a meta-device build: a few floats, computed for real (meta ops
        # would also import torch._dynamo, ~0.8 s of each process's start)
        with torch.device("cpu"):
            inv_freq, self.attention_scaling = inv_frequencies(
                head_dim, theta, scaling, max_position
            )
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq[None, :]  # [T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [T, D]
        return emb.cos() * self.attention_scaling, emb.sin() * self.attention_scaling
