"""Speculative decoding in real deployments: prefill with PCP 2 (unchanged), decode with
speculation (the draft model computes its own prompt KV on the decode side; so does the MTP
layer, from the target's hidden states recomputed over the pulled prompt KV). Greedy output,
streamed text with a stop string included, must equal the monolithic engine's without
speculation; the acceptance counters must add up in the router's /metrics. Four
deployments: the embedded model with n-gram, a random checkpoint with a draft model, a
random DeepSeek-V3 checkpoint (MLA) with its MTP layer, a random Qwen3 checkpoint with a
DSpark draft (k = 5; decode rebuilds the draft's state from the pulled prompt KV)."""

from __future__ import annotations

import asyncio
import re
import urllib.request
from pathlib import Path

import pytest

from pdserve.common.engine.config import EngineConfig
from pdserve.common.engine.llm_engine import LLMEngine
from pdserve.common.engine.sampling import SamplingParams
from pdserve.common.model.fixtures.random import save_random_llama, save_random_model
from tests.e2e import deployment
from tests.test_dspark import TARGET as DSPARK_TARGET
from tests.test_dspark import bigram_draft
from tests.test_mtp_spec import mtp_checkpoint
from tests.test_serving import assert_pools_full
from tests.test_spec_decode import perturbed_copy

pytestmark = pytest.mark.slow

MAX_TOKENS = 16


def cases(mono: LLMEngine) -> list[list[int]]:
    tok = mono.tokenizer
    story = " ".join(f"Line {i}: the {i}th lantern was lit at dusk." for i in range(40))
    return [
        tok.encode_chat([{"role": "user", "content": "Repeat twice: red green blue red green"}]),
        tok.encode("Paris is"),
        tok.encode(story)[:300],  # zigzag pieces on both PCP ranks
    ]


def per_position(url: str) -> dict[int, float]:
    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as resp:
        text = resp.read().decode()
    out: dict[int, float] = {}
    for line in text.splitlines():
        if line.startswith("pdserve:spec_decode_num_accepted_tokens_per_pos_total{"):
            pos = int(re.search(r'position="(\d+)"', line).group(1))  # type: ignore[union-attr]
            out[pos] = out.get(pos, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def counter(url: str, name: str) -> float:
    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as resp:
        text = resp.read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(f"{name}_total{{") and 'service="decode"' in line
    )


@pytest.mark.parametrize("kind", ["embedded-ngram", "random-draft", "deepseek-mtp", "qwen3-dspark"])
def test_disaggregated_speculation_matches_the_monolithic_engine(
    tmp_path: Path, model_dir: Path, kind: str
) -> None:
    from pdserve.services.router.client import AsyncClient

    k = 3
    if kind == "embedded-ngram":
        model = model_dir
        spec = {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 2}
    elif kind == "deepseek-mtp":  # an MTP layer whose drafts get accepted (tests/test_mtp_spec.py)
        model = mtp_checkpoint(tmp_path / "mtp", "dense", model_dir, echo=True)
        spec = {"method": "mtp", "num_speculative_tokens": k}
    elif kind == "qwen3-dspark":  # k = 5, a draft made of the target's bigrams (test_dspark.py)
        k = 5
        model = save_random_model(tmp_path / "qwen3", "qwen3", seed=0,
                                  **{**DSPARK_TARGET, "vocab_size": None})  # fmt: skip
        spec = {"method": "dspark", "num_speculative_tokens": k}
    else:
        model = save_random_llama(tmp_path / "target", num_layers=2, hidden_size=64,
                                  num_heads=4, num_kv_heads=2, intermediate_size=128)  # fmt: skip
        spec = {
            "method": "draft_model",
            "model": str(perturbed_copy(model, tmp_path / "draft", 0.5)),
            "num_speculative_tokens": k,
        }
    mono = LLMEngine(EngineConfig(model=str(model), kv_cache_memory_gb=0.25))
    prompts = cases(mono)
    want = mono.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS))
    if kind == "qwen3-dspark":  # decode rebuilds the draft's state from the pulled KV
        draft = bigram_draft(tmp_path / "dspark", model, [w.token_ids for w in want], num_layers=2)
        spec["model"] = str(draft)
    stop = want[0].text[len(want[0].text) // 2 :][:4]
    [want_stop] = mono.generate(prompts[:1], SamplingParams(max_tokens=MAX_TOKENS, stop=(stop,)))
    engine = {"speculative_config": spec}
    with deployment(tmp_path / "dep", model, pcp=2, engine=engine) as dep:

        async def run() -> tuple[list[list[int]], str]:
            async with AsyncClient(dep.cfg.front_address) as client:
                results = await asyncio.gather(
                    *(
                        client.generate(prompt_token_ids=c, max_tokens=MAX_TOKENS, temperature=0.0)
                        for c in prompts
                    )
                )
                text = ""
                async for chunk in client.stream(
                    prompt_token_ids=prompts[0], max_tokens=MAX_TOKENS, temperature=0.0,
                    stop=[stop],
                ):  # fmt: skip
                    text += chunk.text
            return [r.token_ids for r in results], text

        tokens, streamed = asyncio.run(run())
        assert tokens == [w.token_ids for w in want]
        assert streamed == want_stop.text
        drafts = counter(dep.url, "pdserve:spec_decode_num_drafts")
        drafted = counter(dep.url, "pdserve:spec_decode_num_draft_tokens")
        accepted = counter(dep.url, "pdserve:spec_decode_num_accepted_tokens")
        by_pos = per_position(dep.url)
        assert drafts > 0 and 0 < accepted <= drafted <= drafts * k
        assert sorted(by_pos) == list(range(k))
        assert sum(by_pos.values()) == accepted
        assert all(by_pos[i] >= by_pos[i + 1] for i in range(k - 1))
        assert_pools_full(dep.url)
