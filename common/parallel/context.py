"""ParallelContext: this rank's place in its instance's TP x PCP grid of ranks.

Global rank = pcp_rank * tp_size + tp_rank. The ranks of one PCP rank form a TP group
(heads and MLP split, all-reduce after each row-parallel matmul); the ranks of one TP
rank form a PCP group (zigzag token shards, K/V all-gather). A TP rank only ever talks
to its own TP and PCP groups."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class ParallelContext:
    pcp_rank: int = 0
    pcp_size: int = 1
    group: Any = None  # torch.distributed process group of the PCP ranks
    tp_rank: int = 0
    tp_size: int = 1
    tp_group: Any = None  # torch.distributed process group of the TP ranks

    @property
    def is_parallel(self) -> bool:
        """Context parallel: steps run through prepare_pcp."""
        return self.pcp_size > 1

    @property
    def rank(self) -> int:
        return self.pcp_rank * self.tp_size + self.tp_rank

    def all_reduce_tp(self, x: torch.Tensor) -> torch.Tensor:
        """Sum the partial results of a row-parallel matmul over the TP group (in place)."""
        if self.tp_size > 1:
            import torch.distributed as dist

            dist.all_reduce(x, group=self.tp_group)
        return x

    def gather_padded(self, x: torch.Tensor, num_tokens: int, pad_to: int) -> torch.Tensor:
        """All ranks' ``x`` [2, T_r, ...] (the first ``num_tokens`` rows of dim 1 real),
        each padded to ``pad_to`` and concatenated in rank order: [2, N * pad_to, ...]."""
        import torch.distributed as dist

        padded = x.new_zeros((x.shape[0], pad_to, *x.shape[2:]))
        padded[:, :num_tokens] = x
        parts = [torch.empty_like(padded) for _ in range(self.pcp_size)]
        dist.all_gather(parts, padded.contiguous(), group=self.group)
        return torch.cat(parts, dim=1)


def init_grid(tp_size: int, pcp_size: int, rank: int) -> ParallelContext:
    """This rank's context in an initialised world of tp_size x pcp_size ranks. Every rank
    creates every group, in the same order (torch.distributed requires it)."""
    import torch.distributed as dist

    tp_rank, pcp_rank = rank % tp_size, rank // tp_size
    tp_group = pcp_group = None
    for p in range(pcp_size):
        group = dist.new_group([p * tp_size + t for t in range(tp_size)]) if tp_size > 1 else None
        if p == pcp_rank:
            tp_group = group
    for t in range(tp_size):
        group = dist.new_group([p * tp_size + t for p in range(pcp_size)]) if pcp_size > 1 else None
        if t == tp_rank:
            pcp_group = group
    return ParallelContext(
        pcp_rank=pcp_rank,
        pcp_size=pcp_size,
        group=pcp_group,
        tp_rank=tp_rank,
        tp_size=tp_size,
        tp_group=tp_group,
    )
