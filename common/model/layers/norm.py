"""RMSNorm with HF's arithmetic (normalise in fp32, scale in the input dtype), through
``kernels.rms_norm`` (Triton on CUDA, fused with the residual add)."""

from __future__ import annotations

import torch
from torch import nn

from pdserve import kernels


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 and scale in the input dtype, as the reference does.
        return kernels.rms_norm(x, self.weight, self.eps)[0]

    def add(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual): the residual add fused into the norm."""
        out, total = kernels.rms_norm(x, self.weight, self.eps, residual)
        assert total is not None
        return out, total
