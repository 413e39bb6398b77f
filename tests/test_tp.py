"""Tensor parallelism: the shard math and pull plan (pure), then real deployments whose
prefill runs TP x PCP ranks and whose decode instances run TP 1, 2 and 4, all token-
identical to the monolithic engine at TP 1 (gloo, real NIXL pulls of head slices)."""

from __future__ import annotations

import asyncio
import itertools
import os
from pathlib import Path

import pytest

from pdserve.common.engine.kv_layout import KVLayout
from pdserve.common.parallel.tp import check_tp, kv_heads_of, pull_plan
from pdserve.common.runtime.protocol import KVHandle, Replica
from pdserve.services.decode.pullers import plan_pulls

SIZES = [(8, 4), (8, 8), (8, 2), (9, 3), (32, 8), (8, 1)]  # (heads, KV heads)


def valid_tps(heads: int, kv_heads: int) -> list[int]:
    return [t for t in (1, 2, 3, 4, 8, 16) if check_tp(t, heads, kv_heads, 64 * 48) is None]


@pytest.mark.parametrize(("heads", "kv_heads"), SIZES)
def test_every_consumer_head_comes_from_a_producer_rank_holding_it(
    heads: int, kv_heads: int
) -> None:
    tps = valid_tps(heads, kv_heads)
    for ptp, dtp in itertools.product(tps, tps):
        for rank in range(dtp):
            first, count = kv_heads_of(kv_heads, dtp, rank)
            got = []
            for sl in pull_plan(kv_heads, ptp, dtp, rank):
                p_first, p_count = kv_heads_of(kv_heads, ptp, sl.producer_tp_rank)
                assert 0 <= sl.src_head and sl.src_head + sl.num_heads <= p_count
                got += [(p_first + sl.src_head + i, sl.dst_head + i) for i in range(sl.num_heads)]
            assert got == [(first + i, i) for i in range(count)], (ptp, dtp, rank)


def test_pull_plan_ratios() -> None:
    # decode TP > prefill TP: one slice of one producer rank
    assert [tuple(s) for s in pull_plan(4, 2, 4, 3)] == [(1, 1, 0, 1)]
    # decode TP < prefill TP: slices of several producer ranks
    assert [tuple(s) for s in pull_plan(4, 4, 1, 0)] == [
        (0, 0, 0, 1),
        (1, 0, 1, 1),
        (2, 0, 2, 1),
        (3, 0, 3, 1),
    ]
    # equal: everything of the same rank, one slice
    assert [tuple(s) for s in pull_plan(4, 2, 2, 1)] == [(1, 0, 0, 2)]
    # producer replicates 2 KV heads on 4 ranks: decode ranks spread over the copies
    assert [s.producer_tp_rank for d in range(2) for s in pull_plan(2, 4, 2, d)] == [0, 3]


def test_unmappable_tp_sizes_are_refused_with_both_numbers() -> None:
    assert check_tp(2, 9, 3, 1536) == "9 attention heads do not split over TP 2"
    assert check_tp(4, 8, 3, 64) is not None and "3 KV heads" in check_tp(4, 12, 3, 64)  # type: ignore[operator]
    assert check_tp(2, 8, 4, 63) == "MLP size 63 does not split over TP 2"


def _handle(block_ids: list[int], ptp: int, pcp: int) -> KVHandle:
    layout = KVLayout(
        num_blocks=64,
        num_layers=2,
        num_kv_heads=max(1, 4 // ptp),
        block_size=4,
        head_dim=8,
        dtype="float32",
    )
    replicas = [
        Replica(agent_name=f"a{r}", side_channel="", tp_rank=r % ptp, pcp_rank=r // ptp)
        for r in range(ptp * pcp)
    ]
    return KVHandle(
        engine_id="e",
        epoch=1,
        layout=layout,
        block_ids=block_ids,
        num_tokens=4 * len(block_ids),
        replicas=replicas,
        lease_deadline=0.0,
    )


@pytest.mark.parametrize(
    ("ptp", "pcp", "dtp", "striped"),
    [
        (1, 1, 1, False),
        (2, 2, 4, True),
        (2, 2, 1, False),
        (4, 1, 2, False),
        (1, 2, 4, True),
        (2, 1, 8, False),
    ],
)
def test_plan_reads_each_local_head_of_each_block_once(
    ptp: int, pcp: int, dtp: int, striped: bool
) -> None:
    remote = [3, 4, 5, 6, 7, 20, 21, 40]
    local = [0, 1, 2, 3, 9, 10, 11, 12]
    plan = plan_pulls(_handle(remote, ptp, pcp), local, 4, dtp, striped)
    assert len(plan) == dtp
    for rank, specs in enumerate(plan):
        seen = []
        for spec in specs:
            for _src, dst, n in spec.heads:
                for h in range(n):
                    seen += [(dst + h, lo) for lo in spec.local_block_ids]
            assert [remote[local.index(b)] for b in spec.local_block_ids] == spec.remote_block_ids
        _, count = kv_heads_of(4, dtp, rank)
        assert sorted(seen) == sorted((h, b) for h in range(count) for b in local)
        # striped: the shares come from different PCP replicas
        if striped and pcp > 1:
            assert len({s.replica for s in specs}) > 1


# -- real deployments ----------------------------------------------------------------------

PROMPTS = [
    "The quick brown fox jumps over the lazy dog. " * 9,  # ~90 tokens: two blocks
    "Explain tensor parallelism in one sentence.",
    "def fibonacci(n):\n    " + "a, b = b, a + b\n    " * 20,
]


@pytest.fixture(scope="module")
def tp_model(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> Path:
    pytest.importorskip("transformers")
    from pdserve.common.model.fixtures.random import save_random_llama

    return save_random_llama(
        tmp_path_factory.mktemp("tp-model"),
        num_heads=8,
        num_kv_heads=4,
        hidden_size=128,
        intermediate_size=256,
        num_layers=2,
        tokenizer_from=model_dir,
    )


@pytest.fixture(scope="module")
def reference(tp_model: Path) -> dict[str, list[int]]:
    from pdserve.common.engine.config import EngineConfig
    from pdserve.common.engine.llm_engine import LLMEngine
    from pdserve.common.engine.sampling import SamplingParams

    engine = LLMEngine(EngineConfig(model=str(tp_model), kv_cache_memory_gb=0.05))
    outs = engine.generate(
        [engine.tokenizer.encode(p) for p in PROMPTS], SamplingParams(max_tokens=12)
    )
    return {p: o.token_ids for p, o in zip(PROMPTS, outs, strict=True)}


# CI's slow lane runs the first two; PDSERVE_TP_MATRIX=1 runs all four prefill layouts.
PREFILL_LAYOUTS = [(2, 2), (1, 1), (2, 1), (1, 2)]


@pytest.mark.slow  # a deployment: TP x PCP prefill ranks, decode instances of TP 1, 2 and 4
@pytest.mark.parametrize(("prefill_tp", "pcp"), PREFILL_LAYOUTS)
def test_tp_x_pcp_prefill_to_decode_tp_1_2_4_is_token_identical(
    tmp_path: Path, tp_model: Path, reference: dict[str, list[int]], prefill_tp: int, pcp: int
) -> None:
    if (prefill_tp, pcp) in PREFILL_LAYOUTS[2:] and not os.environ.get("PDSERVE_TP_MATRIX"):
        pytest.skip("set PDSERVE_TP_MATRIX=1 for the whole matrix (CI runs the corners)")
    from pdserve.services.router.client import AsyncClient
    from tests.e2e import deployment
    from tests.test_serving import assert_pools_full, metrics

    striped = "striped" if pcp > 1 else "first"
    with deployment(
        tmp_path,
        tp_model,
        prefill_tp=prefill_tp,
        pcp=pcp,
        decode_instances=3,
        decode_tp=[1, 2, 4],
        pull_from=striped,
        engine={"kv_cache_memory_gb": 0.05},
    ) as d:

        async def run() -> list[tuple[str, list[int]]]:
            async with AsyncClient(d.cfg.front_address) as client:
                jobs = [
                    (p, client.generate(prompt=p, max_tokens=12, temperature=0.0))
                    for p in PROMPTS * 3
                ]
                results = await asyncio.gather(*(job for _, job in jobs))
                return [(p, r.token_ids) for (p, _), r in zip(jobs, results, strict=True)]

        for prompt, tokens in asyncio.run(run()):
            assert tokens == reference[prompt], prompt
        snap = metrics(d.url)
        for instance, tp in enumerate([1, 2, 4]):
            key = f"{{service=decode,instance={instance},rank=0}}"
            transfers = snap.get(f"pdserve:kv_transfers_total{key}", 0)
            assert transfers > 0, f"decode instance {instance} (TP {tp}) served nothing"
            # one descriptor per (KV head, run of blocks), never per block x layer x head:
            # at most one per (head, block) unit moved, each unit being every layer's K and V
            # of one head of one block (2 layers x K, V x 64 tokens x head_dim 16 x fp32).
            # How many runs a pull has depends on how fragmented the two pools are when the
            # 9 requests interleave (a CI run saw 10 a pull on average against a 2-blocks-
            # per-run guess of 8); tests/test_kv_transfer.py checks NIXL's own count equals
            # runs x heads exactly
            descriptors = snap[f"pdserve:kv_transfer_descriptors_total{key}"]
            units = snap[f"pdserve:kv_transfer_bytes_total{key}"] / (2 * 2 * 64 * 16 * 4)
            assert units == int(units) and 0 < descriptors <= units, (descriptors, units)
        for rank in range(prefill_tp * pcp):  # every producer rank released every request
            assert (
                snap[f"pdserve:kv_replica_releases_total{{service=prefill,instance=0,rank={rank}}}"]
                == 9
            )
        assert_pools_full(d.url)


@pytest.mark.slow  # four decode rank processes
def test_kv_heads_replicated_when_tp_exceeds_them(tmp_path: Path, model_dir: Path) -> None:
    """TP 4 over 2 KV heads: each KV head lives on two ranks; greedy tokens as at TP 1."""
    pytest.importorskip("transformers")
    from pdserve.common.engine.config import EngineConfig
    from pdserve.common.engine.llm_engine import LLMEngine
    from pdserve.common.engine.sampling import SamplingParams
    from pdserve.common.model.fixtures.random import save_random_llama
    from pdserve.services.ranks.group import RankGroup

    model = save_random_llama(
        tmp_path / "m",
        num_heads=8,
        num_kv_heads=2,
        hidden_size=128,
        intermediate_size=256,
        num_layers=2,
        tokenizer_from=model_dir,
    )
    cfg = EngineConfig(model=str(model), kv_cache_memory_gb=0.02)
    mono = LLMEngine(cfg)
    prompts = [mono.tokenizer.encode(p) for p in PROMPTS]
    want = [o.token_ids for o in mono.generate(prompts, SamplingParams(max_tokens=10))]
    ranks = RankGroup.decode(cfg, 4, "test-replicated")
    try:
        assert ranks.layout.num_kv_heads == 1
        engine = LLMEngine(cfg, runner=ranks)
        assert [
            o.token_ids for o in engine.generate(prompts, SamplingParams(max_tokens=10))
        ] == want
    finally:
        ranks.close()
