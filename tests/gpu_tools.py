"""Helpers of the GPU tests (pytest -m gpu, on the GPU machine)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def gpu_memory_share(kv_gib: float = 1.0) -> float:
    """An engine's ``gpu_memory_utilization`` that leaves it about ``kv_gib`` GiB of KV cache
    (less its weights) over what this process already holds, on any card: the engine's
    budget is the share of the whole device less this process's allocations, and in one
    pytest run those include earlier tests' tensors (a failed test's frames keep its
    engine alive), so a fixed share that fits a 141 GB card can leave nothing on 80 GB."""
    import torch

    total = torch.cuda.mem_get_info()[1]
    return min(1.0, (torch.cuda.memory_allocated() + kv_gib * 2**30) / total)


def pcp2_over_vram_equals_the_monolithic_engine(
    tmp: Path, model: Path, prompts: list[list[int]], kv_cache_dtype: str, device: str = "cuda"
) -> list[list[int]]:
    """`pdserve up` on one GPU: prefill PCP 2 (two rank processes) to decode TP 1, the
    blocks pulled over NIXL from VRAM to VRAM; greedy tokens (float32) of each prompt sent
    one at a time = the monolithic CUDA engine's, each prompt alone, with the same cache
    dtype; every block back in its pool after. Returns the tokens."""
    import torch

    from pdserve.common.engine.config import EngineConfig
    from pdserve.common.engine.llm_engine import LLMEngine
    from pdserve.common.engine.sampling import SamplingParams
    from pdserve.services.router.client import Client
    from tests.e2e import deployment
    from tests.test_families import NUM_TOKENS
    from tests.test_serving import assert_pools_full

    fields: dict[str, Any] = {
        "dtype": "float32",
        "num_kv_blocks": 4096,
        "kv_cache_dtype": kv_cache_dtype,
    }
    mono = LLMEngine(EngineConfig(model=str(model), device=device, **fields))
    params = SamplingParams(max_tokens=NUM_TOKENS)
    alone = [mono.generate([p], params)[0].token_ids for p in prompts]
    del mono
    if device == "cuda":
        torch.cuda.empty_cache()
    with deployment(tmp, model, device=device, pcp=2, engine=fields) as dep:
        with Client(dep.cfg.front_address, timeout=300) as client:
            got = [
                client.generate(
                    prompt_token_ids=p, max_tokens=NUM_TOKENS, temperature=0.0
                ).token_ids
                for p in prompts
            ]
        assert got == alone
        assert_pools_full(dep.url)
    return got
