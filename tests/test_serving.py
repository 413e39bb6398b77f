"""Disaggregated serving end to end: real processes, real ZMQ sockets, real NIXL pulls.

Outputs are checked token for token against the monolithic engine (the reference that is
itself checked against Hugging Face transformers in test_engine.py).
"""

from __future__ import annotations

import asyncio
import json
import re
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq

from pdserve.cli.deployment import Deployment
from pdserve.common.engine.config import EngineConfig
from pdserve.common.engine.llm_engine import LLMEngine
from pdserve.common.engine.sampling import SamplingParams
from tests.e2e import deployment

pytestmark = pytest.mark.slow

MAX_MODEL_LEN = 512
PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "def fibonacci(n):",
    "List three prime numbers greater than 100.",
]


@pytest.fixture(scope="module")
def dep(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> Iterator[Deployment]:
    with deployment(
        tmp_path_factory.mktemp("dep"), model_dir, engine={"max_model_len": MAX_MODEL_LEN}
    ) as d:
        yield d


@pytest.fixture(scope="module")
def mono(model_dir: Path) -> LLMEngine:
    return LLMEngine(
        EngineConfig(model=str(model_dir), max_model_len=MAX_MODEL_LEN, kv_cache_memory_gb=0.25)
    )


def metrics(url: str) -> dict[str, float]:
    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as resp:
        text = resp.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = re.match(r"^([a-z_:]+)\{(.*)\} (\S+)$", line)
        if m:
            labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2)))
            key = (
                m.group(1)
                + "{"
                + ",".join(
                    f"{k}={labels[k]}" for k in ("service", "instance", "rank") if k in labels
                )
                + "}"
            )
            out[key] = out.get(key, 0.0) + float(m.group(3))
    return out


def total(snapshot: dict[str, float], name: str, service: str | None = None) -> float:
    return sum(
        v
        for k, v in snapshot.items()
        if k.startswith(name + "{") and (service is None or f"service={service}" in k)
    )


def post(url: str, path: str, body: Any, raw: bytes | None = None) -> tuple[int, dict[str, Any]]:
    data = raw if raw is not None else json.dumps(body).encode()
    req = urllib.request.Request(url + path, data, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def assert_pools_full(url: str, within: float = 10.0) -> None:
    """Every prefill and decode pool has all its blocks free, within ``within`` seconds:
    a producer frees its blocks when the consumer's release reaches it, which follows the
    answer (an immediate scrape once found the prefill's last 4 blocks still held)."""
    deadline = time.monotonic() + within
    while True:
        snap = metrics(url)
        pools = [
            (
                total(snap, "pdserve:kv_blocks_free", service),
                total(snap, "pdserve:kv_blocks_total", service),
            )
            for service in ("prefill", "decode")
        ]
        if all(free == size > 0 for free, size in pools) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    for free, size in pools:
        assert free == size > 0, pools


def test_openai_sdk_matches_the_monolithic_engine(dep: Deployment, mono: LLMEngine) -> None:
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{dep.url}/v1", api_key="none")
    tok = mono.tokenizer
    for prompt in PROMPTS:
        want_chat = mono.generate(
            [tok.encode_chat([{"role": "user", "content": prompt}])], SamplingParams(max_tokens=24)
        )[0]
        chat = client.chat.completions.create(
            model=client.models.list().data[0].id,
            messages=[{"role": "user", "content": prompt}],
            max_tokens=24,
            temperature=0,
        )
        assert chat.choices[0].message.content == want_chat.text
        assert chat.usage.completion_tokens == len(want_chat.token_ids)
        streamed = client.chat.completions.create(
            model=chat.model,
            messages=[{"role": "user", "content": prompt}],
            max_tokens=24,
            temperature=0,
            stream=True,
        )
        assert (
            "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
            == want_chat.text
        )
        want_raw = mono.generate([tok.encode(prompt)], SamplingParams(max_tokens=16))[0]
        comp = client.completions.create(
            model=chat.model, prompt=prompt, max_tokens=16, temperature=0
        )
        assert comp.choices[0].text == want_raw.text
        streamed = client.completions.create(
            model=chat.model, prompt=prompt, max_tokens=16, temperature=0, stream=True
        )
        assert "".join(c.choices[0].text for c in streamed if c.choices) == want_raw.text


def test_zmq_sdk_gives_the_same_token_ids(dep: Deployment, mono: LLMEngine) -> None:
    from pdserve.services.router.client import Client

    tok = mono.tokenizer
    with Client(dep.cfg.front_address) as client:
        for prompt in PROMPTS:
            ids = tok.encode(prompt)
            want = mono.generate([ids], SamplingParams(max_tokens=20))[0]
            got = client.generate(prompt_token_ids=ids, max_tokens=20, temperature=0.0)
            assert got.token_ids == want.token_ids and got.text == want.text
            chunks = list(client.stream(prompt_token_ids=ids, max_tokens=20, temperature=0.0))
            assert [t for c in chunks for t in c.token_ids] == want.token_ids


def test_seeded_sampling_matches_across_prefill_and_decode(
    dep: Deployment, mono: LLMEngine
) -> None:
    from pdserve.services.router.client import Client

    ids = mono.tokenizer.encode("Tell me a story about a dragon.")
    p = SamplingParams(max_tokens=16, temperature=0.8, top_p=0.9, seed=42)
    want = mono.generate([ids], p)[0]
    with Client(dep.cfg.front_address) as client:
        got = client.generate(
            prompt_token_ids=ids, max_tokens=16, temperature=0.8, top_p=0.9, seed=42
        )
    assert got.token_ids == want.token_ids


def test_block_edges_context_limit_and_prefix_hits(dep: Deployment, mono: LLMEngine) -> None:
    from pdserve.services.router.client import Client, GenerationFailed

    cases = {
        "shorter than a block": list(range(100, 110)),
        "exactly one block": list(range(200, 264)),
        # the answer's last token lands on the context limit
        "at the context limit": [(i * 7) % 5000 + 10 for i in range(MAX_MODEL_LEN - 8)],
    }
    with Client(dep.cfg.front_address) as client:
        for name, ids in cases.items():
            want = mono.generate([ids], SamplingParams(max_tokens=8))[0]
            got = client.generate(prompt_token_ids=ids, max_tokens=8, temperature=0.0)
            assert got.token_ids == want.token_ids, name
        # one token past it is refused up front, as the HTTP API refuses it (#18)
        with pytest.raises(GenerationFailed, match="max_model_len") as info:
            client.generate(prompt_token_ids=cases["at the context limit"], max_tokens=9)
        assert info.value.reason == "bad_request"
        cached = [(i * 13) % 4000 + 20 for i in range(3 * 64 + 5)]
        first = client.generate(prompt_token_ids=cached, max_tokens=6, temperature=0.0)
        again = client.generate(prompt_token_ids=cached, max_tokens=6, temperature=0.0)
        assert again.token_ids == first.token_ids
        assert first.usage.cached_tokens == 0 and again.usage.cached_tokens == 3 * 64
    assert_pools_full(dep.url)


def test_64_concurrent_requests_complete_and_free_everything(dep: Deployment) -> None:
    openai = pytest.importorskip("openai")
    before = metrics(dep.url)

    async def run() -> list[Any]:
        client = openai.AsyncOpenAI(base_url=f"{dep.url}/v1", api_key="none", timeout=600)
        words = "alpha beta gamma delta epsilon zeta eta theta iota kappa".split()
        prompts = [
            " ".join(words[(i + j) % 10] for j in range(3 + (i * 37) % 150)) for i in range(64)
        ]
        model = (await client.models.list()).data[0].id
        return await asyncio.gather(
            *(
                client.completions.create(
                    model=model, prompt=p, max_tokens=4 + i % 12, temperature=0
                )
                for i, p in enumerate(prompts)
            )
        )

    results = asyncio.run(run())
    assert len(results) == 64 and all(
        r.choices[0].finish_reason in ("stop", "length") for r in results
    )
    after = metrics(dep.url)
    assert (
        total(after, "pdserve:kv_transfers_total") - total(before, "pdserve:kv_transfers_total")
        == 64
    )
    assert (
        total(after, "pdserve:kv_replica_releases_total")
        - total(before, "pdserve:kv_replica_releases_total")
        == 64
    )
    assert total(after, "pdserve:kv_transfer_failures_total") == 0
    assert total(after, "pdserve:kv_notification_failures_total") == 0
    assert total(after, "pdserve:kv_expired_requests_total") == 0
    assert_pools_full(dep.url)


def test_bad_requests_get_clear_errors_and_the_services_keep_serving(dep: Deployment) -> None:
    status, body = post(dep.url, "/v1/completions", None, raw=b"{not json")
    assert status == 400 and body["error"]["message"]
    status, body = post(dep.url, "/v1/completions", {"model": "no-such-model", "prompt": "hi"})
    assert status == 404 and "no-such-model" in body["error"]["message"]  # as OpenAI answers
    assert body["error"]["code"] == "model_not_found"
    status, body = post(dep.url, "/v1/completions", {"prompt": "hi", "max_tokens": -1})
    assert status == 400 and "max_tokens" in body["error"]["message"]
    status, body = post(dep.url, "/v1/completions", {"prompt": "word " * (MAX_MODEL_LEN + 50)})
    assert status == 400 and "max_model_len" in body["error"]["message"]
    # Garbage frames straight at the router's front door and at each service's socket.
    ctx = zmq.Context()
    targets = [dep.cfg.front_address] + [
        a.address for a in dep.cfg.prefill_addresses + dep.cfg.decode_addresses
    ]
    targets += [a.side_channel for a in dep.cfg.prefill_addresses]
    for address in targets:
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(address)
        sock.send(b"\x00\xffgarbage")
        sock.send_multipart([b"two", b"frames"])
        assert sock.poll(10_000), f"no answer from {address}"
        sock.close()
    ctx.term()
    status, body = post(
        dep.url,
        "/v1/completions",
        {"prompt": "Monday, Tuesday,", "max_tokens": 4, "temperature": 0},
    )
    assert status == 200 and body["choices"][0]["text"]
    assert total(metrics(dep.url), "pdserve:bad_messages_total") >= len(targets)


def test_two_prefill_and_two_decode_instances_share_the_load(
    tmp_path: Path, model_dir: Path
) -> None:
    from pdserve.services.router.client import Client

    with deployment(tmp_path, model_dir, prefill_instances=2, decode_instances=2) as d:
        with Client(d.cfg.front_address) as client:

            async def many() -> None:
                from pdserve.services.router.client import AsyncClient

                async with AsyncClient(d.cfg.front_address) as ac:
                    await asyncio.gather(
                        *(
                            ac.generate(
                                prompt_token_ids=[i % 50 + 1000 + j for j in range(20 + i)],
                                max_tokens=8,
                            )
                            for i in range(16)
                        )
                    )

            asyncio.run(many())
            assert client.generate(prompt="hi", max_tokens=2).text
        snap = metrics(d.url)
        for i in range(2):
            assert snap[f"pdserve:kv_transfers_total{{service=decode,instance={i},rank=0}}"] > 0
            assert (
                snap[f"pdserve:kv_replica_releases_total{{service=prefill,instance={i},rank=0}}"]
                > 0
            )
        assert_pools_full(d.url)
