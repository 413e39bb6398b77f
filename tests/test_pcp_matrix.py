"""Prefill context parallelism against transformers over drawn model shapes (CPU).

Each case is drawn from a seeded generator: DeepSeek-V4's sliding window, CSA and HCA
compress rates, index_topk and index_n_heads (1 or 2 heads: a key every head scores below
zero scores exactly 0, so many keys tie and the top-k's choice among them matters), or
DeepSeek-V3.2's index_topk and heads; PCP 2 or 4; the block size; and prompt lengths: one
at random, one whose zigzag pieces (common/parallel/zigzag.py) end one token before, at or
after a compress window's edge, one shorter than a piece per rank. Every prompt of a case
is prefilled in one PCP step (each piece its own pseudo-sequence on its rank), then
decoded on one rank's replica of the cache (tests/pcp_threads.py: the ranks are threads,
the all-gather a barrier), as a deployment's prefill PCP -> decode does; the greedy tokens
must be transformers' ``generate``.

The case the suite once missed: a PCP piece ranked its indexer scores over the keys its
own end sees, transformers over every key of the sequence; torch.topk keeps different keys
among equal scores over a different width (kernels/indexer_ref.py ``rank_rows``), so a
piece that does not end the sequence chose other entries than transformers did.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from pdserve.common.engine.config import EngineConfig
from pdserve.common.engine.llm_engine import LLMEngine
from pdserve.common.engine.sampling import SamplingParams
from tests.test_families import hf_greedy, sentence_prompts

transformers = pytest.importorskip("transformers")

NUM_TOKENS = 4
V4_CASES = 5
V32_CASES = 3


def zigzag_lengths(rng: random.Random, pcp: int, rate: int) -> tuple[int, ...]:
    """A random length; one whose 2N pieces are each a window count of ``rate`` off by -1,
    0 or +1 (plus a remainder for the last pieces); one of fewer tokens than 2N pieces."""
    pieces = 2 * pcp
    per_piece = rate * rng.randint(1, max(1, 40 // rate)) + rng.choice([-1, 0, 1])
    edge = pieces * max(per_piece, 1) + rng.choice([0, 1, pieces - 1])
    return (rng.randint(40, 300), edge, rng.randint(2, pieces + 1))


def v4_case(index: int) -> dict[str, Any]:
    rng = random.Random(4500 + index)
    csa, hca = rng.choice([2, 4, 8]), rng.choice([4, 8, 16, 32, 64])
    pcp = rng.choice([2, 4])
    return {
        "model": {
            "sliding_window": rng.choice([2, 3, 5, 8, 16]),
            "compress_rates": {
                "compressed_sparse_attention": csa,
                "heavily_compressed_attention": hca,
            },
            "index_topk": rng.choice([1, 2, 3, 6, 16]),
            "index_n_heads": rng.choice([1, 2, 8]),
        },
        "pcp": pcp,
        "block_size": rng.choice([8, 16, 64]),
        "lengths": zigzag_lengths(rng, pcp, rng.choice([csa, hca])),
        "decode_rank": rng.randrange(pcp),
    }


def v32_case(index: int) -> dict[str, Any]:
    rng = random.Random(3200 + index)
    pcp = rng.choice([2, 4])
    return {
        "model": {
            "index_topk": rng.choice([1, 4, 16, 64]),
            "index_n_heads": rng.choice([1, 2, 16]),
        },
        "pcp": pcp,
        "block_size": rng.choice([8, 16, 64]),
        "lengths": zigzag_lengths(rng, pcp, rng.choice([4, 16])),
        "decode_rank": rng.randrange(pcp),
    }


def case_id(case: dict[str, Any]) -> str:
    m = case["model"]
    rates = m.get("compress_rates")
    shape = (
        f"w{m['sliding_window']}-csa{rates['compressed_sparse_attention']}"
        f"-hca{rates['heavily_compressed_attention']}-"
        if rates
        else ""
    )
    lengths = "/".join(map(str, case["lengths"]))
    return (
        f"{shape}top{m['index_topk']}-h{m['index_n_heads']}-pcp{case['pcp']}"
        f"-b{case['block_size']}-len{lengths}-r{case['decode_rank']}"
    )


def check_pcp_equals_transformers(model: Path, tokenizer: Path, case: dict[str, Any]) -> None:
    from tests.pcp_threads import ThreadPCP

    prompts = sentence_prompts(tokenizer, case["lengths"], 200)
    want = hf_greedy(model, prompts, NUM_TOKENS)
    config = EngineConfig(
        model=str(model),
        block_size=case["block_size"],
        num_kv_blocks=400,
        enable_prefix_caching=False,
    )
    runner = ThreadPCP(config, case["pcp"], decode_rank=case["decode_rank"])
    try:
        engine = LLMEngine(config, runner=runner)
        got = engine.generate(prompts, SamplingParams(max_tokens=NUM_TOKENS, ignore_eos=True))
        assert runner.prefill_steps == 1  # every prompt's pieces in one PCP step
        assert [o.token_ids for o in got] == want
        assert engine.pool.num_free_blocks == engine.pool.num_blocks
    finally:
        runner.close()


V4_MATRIX = [v4_case(i) for i in range(V4_CASES)]
V32_MATRIX = [v32_case(i) for i in range(V32_CASES)]


@pytest.mark.parametrize("case", V4_MATRIX, ids=[case_id(c) for c in V4_MATRIX])
def test_v4_pcp_prefill_then_decode_equals_transformers(
    tmp_path: Path, model_dir: Path, case: dict[str, Any]
) -> None:
    from pdserve.common.model.fixtures.random import save_random_v4

    model = save_random_v4(tmp_path / "v4", tokenizer_from=model_dir, **case["model"])
    check_pcp_equals_transformers(model, model_dir, case)


@pytest.mark.parametrize("case", V32_MATRIX, ids=[case_id(c) for c in V32_MATRIX])
def test_v32_pcp_prefill_then_decode_equals_transformers(
    tmp_path: Path, model_dir: Path, case: dict[str, Any]
) -> None:
    from tests.test_dsa import build_v32

    model = build_v32(tmp_path / "v32", tokenizer_from=model_dir, **case["model"])
    check_pcp_equals_transformers(model, model_dir, case)


@pytest.mark.slow
def test_v4_deployment_pcp2_to_decode_equals_transformers(tmp_path: Path, model_dir: Path) -> None:
    """The issue's deployment: prefill PCP 2 -> decode over the transfer backend, every
    prompt through prefill, a V4 of one index head (many equal scores) and a small window,
    prompts of several hundred tokens: HF's tokens (before the fix: not the 419-token one)."""
    import asyncio

    from pdserve.common.model.fixtures.random import save_random_v4
    from pdserve.services.router.client import AsyncClient
    from tests.e2e import deployment

    rates = {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128}
    model = save_random_v4(tmp_path / "v4", tokenizer_from=model_dir, sliding_window=16,
                           compress_rates=rates, index_topk=2, index_n_heads=1)  # fmt: skip
    prompts = sentence_prompts(model_dir, (419, 85), 200)
    want = hf_greedy(model, prompts, NUM_TOKENS)

    async def serve(front: str) -> list[list[int]]:
        async with AsyncClient(front, timeout=600) as client:
            return [
                (
                    await client.generate(prompt_token_ids=p, max_tokens=NUM_TOKENS, temperature=0)
                ).token_ids
                for p in prompts
            ]

    with deployment(tmp_path, model, engine={"kv_cache_memory_gb": 0.05}, pcp=2) as dep:
        assert asyncio.run(serve(dep.cfg.front_address)) == want
