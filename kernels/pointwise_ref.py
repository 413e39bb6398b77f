"""Torch reference of the model's pointwise ops (used on CPU; the oracle for Triton).

The arithmetic is Hugging Face Llama's, op for op, in the input dtype: RMSNorm normalises
in float32 and scales in the input dtype; rotary embeddings multiply and add in the input
dtype with cos/sin already cast to it; SiLU-and-mul rounds the SiLU before the product.
"""

from __future__ import annotations

import torch
from torch.nn import functional as F


def rms_norm(
    x: torch.Tensor,  # [T, hidden]
    weight: torch.Tensor,  # [hidden]
    eps: float,
    residual: torch.Tensor | None = None,  # [T, hidden]: added to x first
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(weight * normalise(x + residual), x + residual), or (weight * normalise(x), None)."""
    if residual is not None:
        x = x + residual
        residual = x
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype), residual


def rotary(
    q: torch.Tensor,  # [T, H_q, D]
    k: torch.Tensor,  # [T, H_kv, D]
    cos: torch.Tensor,  # [T, D] in q's dtype
    sin: torch.Tensor,  # [T, D] in q's dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """q and k rotated (HF's rotate_half layout: pairs i and i + D/2)."""
    cos, sin = cos[:, None, :], sin[:, None, :]
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def silu_and_mul(gate_up: torch.Tensor, limit: float | None = None) -> torch.Tensor:
    """[T, 2I] -> [T, I]; with ``limit`` (DeepSeek-V4's experts) the gate clamped above
    and the up projection on both sides at it first."""
    gate, up = gate_up.chunk(2, dim=-1)
    if limit is not None:
        gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
    return F.silu(gate) * up
