"""fp8 KV in a real disaggregated deployment (router + prefill + decode processes, NIXL pulls)
of a small random GQA model in bfloat16: the pull moves the fp8 bytes as stored (half of the
bfloat16 cache's for the same request, in ``pdserve:kv_transfer_bytes``) and decode gives the
monolithic fp8 engine's tokens; a decode whose kv_cache_dtype differs from the prefill's
refuses the producer, naming both."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdserve.common.engine.config import EngineConfig
from pdserve.common.engine.kv_layout import KVLayout
from pdserve.common.engine.llm_engine import LLMEngine
from pdserve.common.engine.sampling_params import SamplingParams
from pdserve.common.model.fixtures.random import save_random_llama
from tests.e2e import deployment
from tests.fault_tools import service_metrics
from tests.test_serving import post

pytest.importorskip("nixl")
pytestmark = pytest.mark.slow

ENGINE = {
    "dtype": "bfloat16",
    "block_size": 16,
    "kv_cache_dtype": "fp8",
    "kv_cache_memory_gb": 0.05,
}
PROMPT = "The days of the week are Monday, Tuesday, Wednesday, Thursday, and the months"
MAX_TOKENS = 8
LAYERS, KV_HEADS, HEAD_DIM = 2, 2, 16


@pytest.fixture(scope="module")
def gqa_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_random_llama(
        tmp_path_factory.mktemp("gqa"),
        hidden_size=128,
        num_heads=8,
        num_kv_heads=KV_HEADS,
        intermediate_size=256,
        num_layers=LAYERS,
    )


def _complete(url: str) -> tuple[int, dict]:
    body = {"prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    return post(url, "/v1/completions", body)


def test_fp8_pull_is_half_the_bytes_and_gives_the_monolithic_tokens(
    tmp_path: Path, gqa_dir: Path
) -> None:
    mono = LLMEngine(EngineConfig(model=str(gqa_dir), **ENGINE))
    assert mono.runner.layout.dtype == "float8_e4m3fn"
    prompt = mono.tokenizer.encode(PROMPT)
    want = mono.tokenizer.decode(
        mono.generate([prompt], SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))[0].token_ids
    )
    with deployment(tmp_path, gqa_dir, engine=ENGINE) as dep:
        status, body = _complete(dep.url)
        decode = service_metrics(dep.cfg.decode_addresses[0].address, "decode")
    assert status == 200, body
    assert body["choices"][0]["text"] == want
    # The pull moves the prompt's blocks (all of them, the last one partly filled).
    num_blocks = -(-len(prompt) // 16)
    shape = dict(
        num_blocks=num_blocks, num_layers=LAYERS, num_kv_heads=KV_HEADS, block_size=16,
        head_dim=HEAD_DIM,
    )  # fmt: skip
    fp8 = KVLayout(**shape, dtype="float8_e4m3fn").total_bytes
    bf16 = KVLayout(**shape, dtype="bfloat16").total_bytes
    pulled = decode["pdserve:kv_transfer_bytes"]
    print(f"prompt {len(prompt)} tokens, {num_blocks} blocks: pulled {pulled:.0f} bytes "
          f"(bf16 cache: {bf16})")  # fmt: skip
    assert pulled == fp8 == bf16 / 2 == num_blocks * 16 * LAYERS * 2 * KV_HEADS * HEAD_DIM


def test_decode_refuses_a_producer_of_another_kv_dtype(tmp_path: Path, gqa_dir: Path) -> None:
    with deployment(
        tmp_path,
        gqa_dir,
        engine=ENGINE,
        prefill_engine={"kv_cache_dtype": "auto"},  # prefill stores bfloat16, decode fp8
    ) as dep:
        status, body = _complete(dep.url)
        decode = service_metrics(dep.cfg.decode_addresses[0].address, "decode")
    assert status >= 500, body
    message = body["error"]["message"]
    assert "this decode stores float8_e4m3fn (--kv-cache-dtype fp8" in message, message
    assert "the producer bfloat16 (--kv-cache-dtype auto)" in message, message
    assert decode.get("pdserve:kv_transfer_bytes", 0) == 0
    assert decode["pdserve:kv_transfer_failures"] == 1
