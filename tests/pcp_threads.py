"""Prefill context parallelism in one process: N rank runners on N threads whose K/V
all-gather is a barrier over shared memory, so the model's PCP path (zigzag pieces,
``ModelRunner.prepare_pcp``, group metadata, each layer's gathered rows) runs for real
without starting rank processes (tests/test_pcp_matrix.py).

``ThreadPCP`` is a runner for ``LLMEngine``: a step with no decode rows (a prefill, or a
chunk of one) runs on the N ranks; the other steps run on a plain runner over one rank's
cache (``decode_rank``: every rank holds a whole replica), which then holds every block a
decode instance would pull from that replica, as a deployment's prefill PCP N -> decode
does.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from pdserve.common.engine.config import EngineConfig
from pdserve.common.engine.model_runner import ModelRunner
from pdserve.common.engine.step_plan import StepPlan
from pdserve.common.model.checkpoint.config import ModelConfig
from pdserve.common.parallel.context import ParallelContext


class Hub:
    """The all-gather of N threads: each puts its part, all read every part."""

    def __init__(self, num: int) -> None:
        self.parts: list[Any] = [None] * num
        self.barrier = threading.Barrier(num, timeout=120)

    def gather(self, rank: int, part: torch.Tensor) -> torch.Tensor:
        self.parts[rank] = part
        self.barrier.wait()
        out = torch.cat(self.parts, dim=1)
        self.barrier.wait()  # nobody overwrites its part before all have read it
        return out


@dataclass(frozen=True)
class ThreadContext(ParallelContext):
    hub: Any = field(default=None, compare=False)

    def gather_padded(self, x: torch.Tensor, num_tokens: int, pad_to: int) -> torch.Tensor:
        padded = x.new_zeros((x.shape[0], pad_to, *x.shape[2:]))
        padded[:, :num_tokens] = x
        return self.hub.gather(self.pcp_rank, padded)


class ThreadPCP:
    """``num_ranks`` PCP rank runners (prefill steps) and a plain runner on rank
    ``decode_rank``'s cache (decode steps)."""

    def __init__(self, config: EngineConfig, num_ranks: int, decode_rank: int = 0) -> None:
        model_dir = Path(config.model)
        cfg = ModelConfig.from_dir(model_dir)
        hub = Hub(num_ranks)
        self.ranks = [
            ModelRunner.from_config(
                cfg,
                model_dir,
                config,
                parallel=ThreadContext(pcp_rank=r, pcp_size=num_ranks, hub=hub),
            )
            for r in range(num_ranks)
        ]
        self.plain = ModelRunner.from_config(cfg, model_dir, config)
        self.plain.kv_cache = self.ranks[decode_rank].kv_cache
        self.pool = ThreadPoolExecutor(num_ranks)
        self.prefill_steps = 0

    def __getattr__(self, name: str) -> Any:  # layout, last_prompt_logprobs, ...
        return getattr(self.plain, name)

    def execute(self, plan: StepPlan, carry: Any = None) -> torch.Tensor:
        if any(len(s.token_ids) == 1 for s in plan.seqs):
            return self.plain.execute(plan, carry)
        self.prefill_steps += 1
        futures = [self.pool.submit(r.execute, plan, carry) for r in self.ranks]
        logits = [f.result() for f in futures]
        return logits[0]

    def close(self) -> None:
        self.pool.shutdown()
