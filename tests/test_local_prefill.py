"""Conditional disaggregation on a real deployment (router, prefill and decode processes):
prompts whose uncached part is short are prefilled by the decode instance, with the
greedy tokens of the disaggregated path, decode's prefix-cache hits reported, and every
block freed."""

from __future__ import annotations

import random
import urllib.request
from pathlib import Path

import pytest

from pdserve.common.engine.config import EngineConfig
from pdserve.common.engine.llm_engine import LLMEngine
from pdserve.common.engine.sampling import SamplingParams
from pdserve.services.router.client import Client
from tests.e2e import deployment
from tests.fault_suite import addresses
from tests.fault_tools import pools_full, service_metrics, wait_until

pytestmark = pytest.mark.slow

THRESHOLD = 100  # tokens; blocks are 64


def local_prefills(url: str) -> dict[str, float]:
    """pdserve:local_prefills_total by reason, from the router's /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as resp:
        text = resp.read().decode()
    return {
        sample.labels["reason"]: sample.value
        for family in text_string_to_metric_families(text)
        if family.name == "pdserve:local_prefills"
        for sample in family.samples
    }


def test_short_uncached_prompts_are_prefilled_on_decode(tmp_path: Path, model_dir: Path) -> None:
    rng = random.Random(0)
    long_prompt = [rng.randrange(1000, 30000) for _ in range(150)]  # 2 full blocks + 22
    short_prompt = [rng.randrange(1000, 30000) for _ in range(40)]
    mono = LLMEngine(EngineConfig(model=str(model_dir), kv_cache_memory_gb=0.1))
    want = [
        out.token_ids
        for out in mono.generate([long_prompt, short_prompt], SamplingParams(max_tokens=8))
    ]
    with (
        deployment(tmp_path, model_dir, local_prefill_threshold=THRESHOLD) as dep,
        Client(dep.cfg.front_address) as client,
    ):
        decode = dep.cfg.decode_addresses[0].address
        assert local_prefills(dep.url) == {"short": 0, "prefill_behind": 0, "faster_here": 0}
        # 150 uncached tokens, an idle prefill instance: disaggregated, KV pulled
        first = client.generate(prompt_token_ids=long_prompt, max_tokens=8, temperature=0)
        assert first.token_ids == want[0]
        assert service_metrics(decode, "decode")["pdserve:kv_transfers"] == 1
        assert local_prefills(dep.url)["short"] == 0
        # 40 tokens: decode computes them (no pull) and gives the same greedy tokens
        short = client.generate(prompt_token_ids=short_prompt, max_tokens=8, temperature=0)
        assert short.token_ids == want[1]
        assert local_prefills(dep.url)["short"] == 1
        # the long prompt again: decode holds its 2 pulled blocks, 22 tokens are left:
        # prefilled there, from its own prefix cache, counted in usage
        again = client.generate(prompt_token_ids=long_prompt, max_tokens=8, temperature=0)
        assert again.token_ids == want[0]
        assert again.usage.cached_tokens == 128
        assert local_prefills(dep.url)["short"] == 2
        assert service_metrics(decode, "decode")["pdserve:kv_transfers"] == 1
        # a local prefill aborted by its client after its first token
        for _ in client.stream(prompt_token_ids=short_prompt[:30], max_tokens=200):
            break
        assert local_prefills(dep.url)["short"] == 3
        wait_until(lambda: pools_full(addresses(dep)), 20, "every KV block to be free")
