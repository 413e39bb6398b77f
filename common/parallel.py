"""ParallelContext: this rank's place in the prefill context-parallel (PCP) group."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class ParallelContext:
    pcp_rank: int = 0
    pcp_size: int = 1
    group: Any = None  # torch.distributed process group of the PCP ranks

    @property
    def is_parallel(self) -> bool:
        return self.pcp_size > 1

    def gather_padded(self, x: torch.Tensor, num_tokens: int, pad_to: int) -> torch.Tensor:
        """All ranks' ``x`` [2, T_r, ...] (the first ``num_tokens`` rows of dim 1 real),
        each padded to ``pad_to`` and concatenated in rank order: [2, N * pad_to, ...]."""
        import torch.distributed as dist

        padded = x.new_zeros((x.shape[0], pad_to, *x.shape[2:]))
        padded[:, :num_tokens] = x
        parts = [torch.empty_like(padded) for _ in range(self.pcp_size)]
        dist.all_gather(parts, padded.contiguous(), group=self.group)
        return torch.cat(parts, dim=1)
