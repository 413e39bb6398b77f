"""fp8 KV on an MLA model in real disaggregated deployments (router + prefill + decode
processes, NIXL pulls): the decode pulls the fp8_ds_mla records as stored, 656 bytes per
token per layer at kv_lora_rank 512 + rope 64 (``pdserve:kv_transfer_bytes``), and gives
the monolithic fp8 engine's tokens; with a prefill of TP 2 x PCP 2 (4 byte-identical
replicas, each rank quantizes the same gathered latent) to a decode of TP 2, each decode rank
reads the whole latent and every producer rank is released once; colocated, the decode
instance prefills into its own fp8_ds_mla cache.

The model: a random DeepseekV3ForCausalLM of transformers' classes, 2 dense layers, hidden
64, 4 heads, kv_lora_rank 512, rope 64 (DeepSeek-V3's latent), float32.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from pdserve.common.engine.config import EngineConfig
from pdserve.common.engine.llm_engine import LLMEngine
from pdserve.common.engine.sampling_params import SamplingParams
from tests.e2e import deployment
from tests.test_fp8_mla import build_fp8_mla
from tests.test_serving import assert_pools_full, metrics, total

pytest.importorskip("nixl")
pytestmark = pytest.mark.slow

LAYERS, BLOCK = 2, 16
RECORD = 656  # 512 fp8 latent + 4 fp32 scales + 64 bf16 rope
ENGINE = {
    "dtype": "float32",
    "block_size": BLOCK,
    "kv_cache_dtype": "fp8",
    "kv_cache_memory_gb": 0.05,
}
TEXTS = [
    "The days of the week are Monday, Tuesday, Wednesday, Thursday, and the months",
    "The quick brown fox jumps over the lazy dog. " * 12,  # ~120 tokens: several blocks
]
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def v3_latent_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_fp8_mla(
        tmp_path_factory.mktemp("fp8mla-pd"), kv_lora_rank=512, qk_rope_head_dim=64
    )


@pytest.fixture(scope="module")
def mono_tokens(v3_latent_dir: Path) -> tuple[list[list[int]], list[list[int]]]:
    """(prompts, greedy tokens) of the monolithic engine with the fp8_ds_mla cache."""
    mono = LLMEngine(EngineConfig(model=str(v3_latent_dir), **ENGINE))
    assert mono.runner.layout.dtype == "uint8" and mono.runner.layout.head_dim == RECORD
    prompts = [mono.tokenizer.encode(t) for t in TEXTS]
    out = mono.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
    return prompts, [o.token_ids for o in out]


def _serve(front: str, prompts: list[list[int]]) -> list[list[int]]:
    import asyncio

    from pdserve.services.router.client import AsyncClient

    async def run() -> list[list[int]]:
        async with AsyncClient(front, timeout=600) as client:
            results = await asyncio.gather(
                *(
                    client.generate(
                        prompt_token_ids=p, max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True
                    )
                    for p in prompts
                )
            )
        return [r.token_ids for r in results]

    return asyncio.run(run())


def _pulled_blocks(prompts: list[list[int]]) -> int:
    return sum(-(-len(p) // BLOCK) for p in prompts)


def test_fp8_mla_pull_is_656_bytes_a_token_and_layer(
    tmp_path: Path, v3_latent_dir: Path, mono_tokens: tuple[list[list[int]], list[list[int]]]
) -> None:
    prompts, want = mono_tokens
    with deployment(tmp_path, v3_latent_dir, engine=ENGINE) as dep:
        got = _serve(dep.cfg.front_address, prompts)
        snap = metrics(dep.url)
        assert_pools_full(dep.url)
    assert got == want
    pulled = total(snap, "pdserve:kv_transfer_bytes_total", "decode")
    slots = _pulled_blocks(prompts) * BLOCK  # whole blocks move, the last one partly filled
    print(f"{slots} token slots x {LAYERS} layers: pulled {pulled:.0f} bytes")
    assert pulled == slots * LAYERS * RECORD  # bfloat16 latent: 1152 a token and layer


def test_fp8_mla_tp2_x_pcp2_prefill_to_decode_tp2(
    tmp_path: Path, v3_latent_dir: Path, mono_tokens: tuple[list[list[int]], list[list[int]]]
) -> None:
    prompts, want = mono_tokens
    with deployment(
        tmp_path,
        v3_latent_dir,
        engine=ENGINE,
        prefill_tp=2,
        pcp=2,
        decode_tp=2,
        pull_from="striped",
    ) as dep:
        got = _serve(dep.cfg.front_address, prompts)
        snap = metrics(dep.url)
        assert_pools_full(dep.url)
    assert got == want
    for rank in range(4):
        key = f"{{service=prefill,instance=0,rank={rank}}}"
        assert snap[f"pdserve:kv_replica_releases_total{key}"] == len(prompts), rank
    # each of the 2 decode ranks reads every block's records
    pulled = total(snap, "pdserve:kv_transfer_bytes_total", "decode")
    assert pulled == 2 * _pulled_blocks(prompts) * BLOCK * LAYERS * RECORD


def test_fp8_mla_colocated_gives_the_monolithic_tokens(
    tmp_path: Path, v3_latent_dir: Path, mono_tokens: tuple[list[list[int]], list[list[int]]]
) -> None:
    """Colocated: the decode instance prefills into its own fp8_ds_mla cache, nothing pulled."""
    prompts, want = mono_tokens
    with deployment(tmp_path, v3_latent_dir, engine=ENGINE, colocated=True) as dep:
        got = _serve(dep.cfg.front_address, prompts)
        snap = metrics(dep.url)
    assert got == want
    assert total(snap, "pdserve:kv_transfer_bytes_total", "decode") == 0
    free = total(snap, "pdserve:kv_blocks_free", "decode")
    assert free == total(snap, "pdserve:kv_blocks_total", "decode") > 0
