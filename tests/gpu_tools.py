"""Helpers of the GPU tests (pytest -m gpu, on the GPU machine)."""

from __future__ import annotations


def gpu_memory_share(kv_gib: float = 1.0) -> float:
    """An engine's ``gpu_memory_utilization`` that leaves it about ``kv_gib`` GiB of KV cache
    (less its weights) over what this process already holds, on any card: the engine's
    budget is the share of the whole device less this process's allocations, and in one
    pytest run those include earlier tests' tensors (a failed test's frames keep its
    engine alive), so a fixed share that fits a 141 GB card can leave nothing on 80 GB."""
    import torch

    total = torch.cuda.mem_get_info()[1]
    return min(1.0, (torch.cuda.memory_allocated() + kv_gib * 2**30) / total)
