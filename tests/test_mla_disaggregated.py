"""MLA disaggregated: the latent is the same on every TP and PCP rank of a prefill, so a
prefill of TP N x PCP M publishes N x M replicas of each block. Decode reads each block
once (replica 0, or striped over the replicas) -- at decode TP > 1 every decode rank reads
the whole latent itself (``tp.pull_plan`` with one "KV head": each rank its own copy) --
and releases every producer rank exactly once (``pdserve:kv_replica_releases``).

Three deployments (slow): prefill TP 2 x PCP 2 to decode instances of TP 1 and TP 2 (striped
pulls, 20 concurrent requests plus HF-checked prompts); prefill TP 1 x PCP 1 to decode TP 2
(bytes: each decode rank reads the whole latent); prefill TP 2 x PCP 2 whose decode is
killed mid-pull (every replica expires once).
Greedy output equals HF transformers'. One TP-2 rank group in-process checks the weight
shards (q_b/kv_b/o_proj by heads, the latent's projections replicated) against HF first.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from pathlib import Path

import pytest

from pdserve.common.engine.latent_format import cache_head
from pdserve.common.model.checkpoint.config import ModelConfig
from pdserve.services.router.client import Result
from tests.test_families import hf_greedy
from tests.test_mla import build_mla

pytestmark = pytest.mark.slow

TEXTS = [
    "Monday, Tuesday,",
    "The quick brown fox jumps over the lazy dog. " * 30,  # ~300 tokens: several 64-blocks
]
NUM_TOKENS = 12


@pytest.fixture(scope="module")
def mla_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_mla(tmp_path_factory.mktemp("mla-pd"), "v3-yarn")


@pytest.fixture(scope="module")
def reference(mla_model: Path, model_dir: Path) -> dict[str, list[int]]:
    from pdserve.common.model.checkpoint.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(model_dir)
    want = hf_greedy(mla_model, [tok.encode(t) for t in TEXTS], NUM_TOKENS)
    return dict(zip(TEXTS, want, strict=True))


def test_tp2_rank_group_matches_transformers(
    mla_model: Path, reference: dict[str, list[int]]
) -> None:
    from pdserve.common.engine.config import EngineConfig
    from pdserve.common.engine.llm_engine import LLMEngine
    from pdserve.common.engine.sampling import SamplingParams
    from pdserve.services.ranks.group import RankGroup

    cfg = EngineConfig(model=str(mla_model), kv_cache_memory_gb=0.02)
    ranks = RankGroup.decode(cfg, 2, "test-mla-tp2")
    try:
        assert ranks.layout.num_kv_heads == 1 and ranks.layout.num_kv_parts == 1
        engine = LLMEngine(cfg, runner=ranks)
        prompts = [engine.tokenizer.encode(t) for t in TEXTS]
        got = engine.generate(prompts, SamplingParams(max_tokens=NUM_TOKENS))
        assert [o.token_ids for o in got] == [reference[t] for t in TEXTS]
    finally:
        ranks.close()


def _serve(front: str, prompts: list[str | list[int]]) -> list[Result]:
    from pdserve.services.router.client import AsyncClient

    async def run() -> list[Result]:
        async with AsyncClient(front, timeout=600) as client:
            results = await asyncio.gather(
                *(
                    client.generate(prompt=p, max_tokens=NUM_TOKENS, temperature=0.0)
                    if isinstance(p, str)
                    else client.generate(prompt_token_ids=p, max_tokens=3, temperature=0.0)
                    for p in prompts
                )
            )
        return list(results)

    return asyncio.run(run())


def test_tp2_x_pcp2_prefill_to_decode_tp_1_and_2(
    tmp_path: Path, mla_model: Path, reference: dict[str, list[int]]
) -> None:
    """4 producer ranks, each holding every block: 20 token-id requests of 1-200 tokens
    plus the HF prompts twice, over two decode instances; every producer rank releases
    every request exactly once, none expires, every pool is full again."""
    from tests.e2e import deployment
    from tests.test_serving import assert_pools_full, metrics, total

    extra: list[str | list[int]] = [
        [(i * 13 + j) % 30000 + 100 for j in range(1 + (i * 37) % 200)] for i in range(20)
    ]
    prompts: list[str | list[int]] = [*TEXTS, *TEXTS, *extra]
    with deployment(
        tmp_path,
        mla_model,
        prefill_tp=2,
        pcp=2,
        decode_instances=2,
        decode_tp=[1, 2],
        pull_from="striped",
        engine={"kv_cache_memory_gb": 0.05},
    ) as dep:
        got = [r.token_ids for r in _serve(dep.cfg.front_address, prompts)]
        for text, tokens in zip(prompts[:4], got[:4], strict=True):
            assert isinstance(text, str) and tokens == reference[text], text
        snap = metrics(dep.url)
        for rank in range(4):
            key = f"{{service=prefill,instance=0,rank={rank}}}"
            assert snap[f"pdserve:kv_replica_releases_total{key}"] == len(prompts), rank
            assert snap.get(f"pdserve:kv_expired_requests_total{key}", 0) == 0, rank
        assert total(snap, "pdserve:kv_transfers_total", "decode") == len(prompts)
        for instance in range(2):
            key = f"{{service=decode,instance={instance},rank=0}}"
            assert snap.get(f"pdserve:kv_transfers_total{key}", 0) > 0, instance
        assert_pools_full(dep.url)


def test_tp1_prefill_to_decode_tp2_reads_the_whole_latent_per_rank(
    tmp_path: Path, mla_model: Path, reference: dict[str, list[int]]
) -> None:
    from tests.e2e import deployment
    from tests.test_serving import assert_pools_full, metrics, total

    with deployment(tmp_path, mla_model, decode_tp=2, engine={"kv_cache_memory_gb": 0.05}) as dep:
        results = _serve(dep.cfg.front_address, list(TEXTS))
        assert [r.token_ids for r in results] == [reference[t] for t in TEXTS]
        snap = metrics(dep.url)
        assert snap["pdserve:kv_replica_releases_total{service=prefill,instance=0,rank=0}"] == 2
        # each of the 2 decode ranks reads every block's latent rows (fp32, all layers)
        cfg, block = ModelConfig.from_dir(mla_model), dep.cfg.engine.block_size
        block_bytes = cfg.num_hidden_layers * block * cache_head(cfg, "float32")[0] * 4
        blocks = sum(-(-r.usage.prompt_tokens // block) for r in results)
        assert total(snap, "pdserve:kv_transfer_bytes_total", "decode") == 2 * blocks * block_bytes
        assert_pools_full(dep.url)


def test_decode_killed_mid_pull_expires_each_of_the_four_replicas_once(
    tmp_path: Path, mla_model: Path
) -> None:
    """Prefill TP 2 x PCP 2 (4 latent replicas); decode holds the pull and is killed: the
    request fails naming the peer, and at lease expiry each producer rank frees its replica
    once (kv_expired_requests 1 on every rank, no release counted), the pool full again."""
    from pdserve.common.runtime.fault_hooks import HOLD_PULLS_ENV
    from tests.e2e import deployment
    from tests.fault_suite import (
        DETECT_BOUND,
        FAST,
        LEASE_BOUND,
        PROMPT,
        decode_waiting,
        failure_of,
        in_background,
    )
    from tests.fault_tools import pools_full, service_metrics, wait_until
    from tests.test_serving import metrics

    hold = tmp_path / "hold-pulls"
    hold.touch()
    flags = dict(FAST, prefill_tp=2, pcp=2)
    env = {HOLD_PULLS_ENV: str(hold)}
    with deployment(tmp_path, mla_model, env=env, **flags) as dep:  # type: ignore[arg-type]
        prefill = dep.cfg.prefill_addresses[0].address
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            fut = in_background(pool, dep, PROMPT, max_tokens=4)
            wait_until(lambda: decode_waiting(dep), 60, "decode to hold the pull")
            dep.kill("decode-0")
            err = failure_of(fut, DETECT_BOUND)
        hold.unlink()
        assert err.reason == "peer_down" and "decode-0" in err.message, err
        wait_until(
            lambda: service_metrics(prefill, "prefill")["pdserve:kv_expired_requests"] >= 4,
            LEASE_BOUND,
            "every replica's lease to expire",
        )
        wait_until(lambda: pools_full([(prefill, "prefill")]), 5, "the producer's pool to be full")
        snap = metrics(dep.url)
        for rank in range(4):
            key = f"{{service=prefill,instance=0,rank={rank}}}"
            assert snap[f"pdserve:kv_expired_requests_total{key}"] == 1, rank
            assert snap.get(f"pdserve:kv_replica_releases_total{key}", 0) == 0, rank
