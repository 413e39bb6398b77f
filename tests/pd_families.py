"""A model's prompts through a prefill of PCP 4 to decode instances of TP 1 and TP 2
(`pdserve up`, slow): DeepSeek-V3.2 (tests/test_dsa.py) and V4 (tests/test_dsv4.py).

PCP 4 cuts each prompt into 8 zigzag pieces, so V3.2's indexer selects among keys of every
rank's pieces and V4's windows and compression strides straddle pieces; each of the 4 ranks
gathers every new row and holds a whole replica of every block. The TP 2 decode instance's
ranks each pull the whole rows (one "KV head") from one replica, and split the heads and
experts (V4: common/model/deepseek/dsv4_tp.py).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from tests.test_families import NUM_TOKENS

NUM_PCP = 4


def pcp4_to_decode_tp_1_and_2(
    tmp: Path, model: Path, prompts: list[list[int]], reference: list[list[int]]
) -> None:
    """Each prompt twice, all at once, so that both decode instances (TP 1 and TP 2) take
    some: HF's tokens; each producer rank releases each request once and none expires;
    every pool full after."""
    from pdserve.services.router.client import AsyncClient, Result
    from tests.e2e import deployment
    from tests.test_serving import assert_pools_full, metrics, total

    batch = prompts * 2

    async def serve(front: str) -> list[Result]:
        async with AsyncClient(front, timeout=600) as client:
            return list(
                await asyncio.gather(
                    *(
                        client.generate(prompt_token_ids=ids, max_tokens=NUM_TOKENS, temperature=0)
                        for ids in batch
                    )
                )
            )

    with deployment(
        tmp,
        model,
        pcp=NUM_PCP,
        decode_instances=2,
        decode_tp=[1, 2],
        engine={"kv_cache_memory_gb": 0.05},
    ) as dep:
        got = [r.token_ids for r in asyncio.run(serve(dep.cfg.front_address))]
        assert got == reference * 2
        snap = metrics(dep.url)
        for rank in range(NUM_PCP):
            key = f"{{service=prefill,instance=0,rank={rank}}}"
            assert snap[f"pdserve:kv_replica_releases_total{key}"] == len(batch), rank
            assert snap.get(f"pdserve:kv_expired_requests_total{key}", 0) == 0, rank
        assert total(snap, "pdserve:kv_transfers_total", "decode") == len(batch)
        for instance in range(2):  # TP 1 and TP 2 both decoded some of them
            key = f"{{service=decode,instance={instance},rank=0}}"
            assert snap.get(f"pdserve:kv_transfers_total{key}", 0) > 0, instance
        assert_pools_full(dep.url)
