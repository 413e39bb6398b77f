"""Run one SparseMoeBlock with expert parallelism over N real gloo ranks (spawned processes).

Each rank builds the block for its place in a TP group of N (common/parallel/context.py:
init_grid), takes its experts and its slice of the shared experts from the full block's
state dict, and runs every case's hidden states; rank 0's outputs come back (every rank
ends with the same sums after the all-reduce; the worker checks that too).
"""

from __future__ import annotations

import multiprocessing as mp
import os
from typing import Any

import numpy as np
import torch

from pdserve.common.model.checkpoint.moe_config import MoEConfig, local_experts

Case = tuple[MoEConfig, dict[str, np.ndarray], np.ndarray]  # (moe, block state, x [T, H])


def rank_state(
    state: dict[str, torch.Tensor], moe: MoEConfig, tp: int, rank: int
) -> dict[str, torch.Tensor]:
    """The block's parameters that TP rank ``rank`` holds."""
    first, count = local_experts(moe.num_experts, tp, rank)
    out = {}
    for name, t in state.items():
        if name.startswith("experts."):
            t = t.narrow(0, first, count)
        elif name.startswith("shared_experts."):
            dim = 1 if name.startswith("shared_experts.down_proj") else 0
            m = t.shape[dim] // tp
            t = t.narrow(dim, rank * m, m)
        out[name] = t.contiguous()
    return out


def _worker(rank: int, tp: int, port: int, cases: list[Case], results: Any) -> None:
    import torch.distributed as dist

    from pdserve.common.model.layers.moe import SparseMoeBlock
    from pdserve.common.parallel.context import init_grid

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=tp)
    try:
        par = init_grid(tp, 1, rank)
        outs = []
        for moe, state, x in cases:
            full = {k: torch.from_numpy(v) for k, v in state.items()}
            block = SparseMoeBlock(x.shape[1], moe, par)
            block.load_state_dict(rank_state(full, moe, tp, rank))
            with torch.inference_mode():
                out = block(torch.from_numpy(x))
            outs.append(out.numpy())
        gathered: list[Any] = [None] * tp
        dist.all_gather_object(gathered, outs)
        same = all(np.array_equal(a, b) for o in gathered for a, b in zip(o, outs, strict=True))
        if rank == 0:
            results.put(outs if same else "ranks ended with different sums")
    finally:
        dist.destroy_process_group()


def run_ep(tp: int, cases: list[Case], port: int) -> list[np.ndarray]:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    procs = [ctx.Process(target=_worker, args=(r, tp, port, cases, results)) for r in range(tp)]
    for p in procs:
        p.start()
    try:
        got = results.get(timeout=300)
    finally:
        for p in procs:
            p.join(timeout=60)
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    assert not isinstance(got, str), got
    return list(got)
