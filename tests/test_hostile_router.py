"""Issue 19, the router's side, against the shared deployment (tests/hostile_tools.py): a
huge prompt neither freezes the router nor fails other users' streams, one client cannot
take every slot, an SDK notices a frozen router within a bound."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
import signal
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from pdserve.cli.deployment import Deployment
from pdserve.common.runtime.sockets import HEARTBEAT_IVL_MS, HEARTBEAT_TIMEOUT_MS
from tests.fault_tools import FaultReport, wait_until
from tests.hostile_tools import PER_CLIENT, PROMPT, add_row, client, router_metrics, still_serving

pytestmark = pytest.mark.slow

STREAM_TOKENS = 24


@pytest.fixture
def dep(hostile_dep: Deployment) -> Deployment:
    return hostile_dep


def post(dep: Deployment, body: dict[str, Any], timeout: float = 120) -> tuple[int, dict[str, Any]]:
    req = urllib.request.Request(f"{dep.url}/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})  # fmt: skip
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, dict(json.loads(resp.read()))
    except urllib.error.HTTPError as err:
        return err.code, dict(json.loads(err.read()))


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for {pid}")


def streams_beside(dep: Deployment, n: int, action: Any) -> tuple[Any, list[int]]:
    """Run ``action()`` while ``n`` SDK streams generate; (its result, their lengths)."""

    def stream(k: int) -> int:
        with client(dep) as c:
            out = c.generate(prompt_token_ids=PROMPT + [k], max_tokens=STREAM_TOKENS,
                             ignore_eos=True)  # fmt: skip
            return len(out.token_ids)

    with concurrent.futures.ThreadPoolExecutor(n) as pool:
        futures = [pool.submit(stream, k) for k in range(n)]
        result = action()
        return result, [f.result(timeout=180) for f in futures]


def test_a_huge_prompt_is_refused_untokenised_and_streams_go_on(
    hostile_report: FaultReport, dep: Deployment
) -> None:
    """Issue item 3: a 7-10 MB body froze the router 7-10 s; 8 unrelated streams failed
    with 503 peer_down blaming a healthy decode; router RSS went to 5.7 GB."""
    before = router_metrics(dep)
    rss_before = rss_mb(dep.procs["router"].pid)
    started = time.monotonic()
    (status, body), lengths = streams_beside(
        dep, 4, lambda: post(dep, {"prompt": "lorem ipsum " * 700_000, "max_tokens": 4})
    )
    took = time.monotonic() - started
    grown = rss_mb(dep.procs["router"].pid) - rss_before
    assert grown < 512, f"the router grew by {grown:.0f} MB"  # was 5.6 GB, kept
    assert status == 400 and body["error"]["code"] == "prompt_too_long", body
    assert "characters" in body["error"]["message"]
    assert lengths == [STREAM_TOKENS] * 4
    after = router_metrics(dep)
    assert after["pdserve:peer_down_total"] == before["pdserve:peer_down_total"]
    still_serving(dep)
    add_row(
        hostile_report,
        dep,
        "8.4M-character prompt beside 4 streams",
        5,
        5,
        f"400 prompt_too_long untokenised; 4/4 streams finished in {took:.1f} s; no "
        f"peer_down; router RSS {grown:+.0f} MB",
    )


def test_a_long_prompt_is_tokenised_in_the_pool(
    hostile_report: FaultReport, dep: Deployment
) -> None:
    """A prompt within the character bound is tokenised in a worker process: its answer
    comes from the token count, the streams beside it finish."""
    from pdserve.services.router.client import GenerationFailed

    text = "hello world " * 50_000  # 600k characters, ~100k tokens: over max_model_len
    (status, body), lengths = streams_beside(dep, 3, lambda: post(dep, {"prompt": text}))
    assert status == 400 and "max_model_len" in body["error"]["message"], body
    assert "tokens" in body["error"]["message"]
    assert lengths == [STREAM_TOKENS] * 3
    with client(dep) as c, pytest.raises(GenerationFailed) as info:  # the SDK's path too
        c.generate(text, max_tokens=2)
    assert info.value.reason == "bad_request" and "max_model_len" in info.value.message
    still_serving(dep)
    add_row(
        hostile_report,
        dep,
        "600k-character prompt (HTTP and SDK) beside 3 streams",
        5,
        5,
        "tokenised in the pool: 400 over max_model_len; 3/3 streams finished",
    )


def test_one_client_cannot_take_every_slot(
    hostile_report: FaultReport, dep: Deployment, hostile_hold: Path
) -> None:
    """Issue item 7: one /v1/completions with 1,100 prompts took all 1,024 router slots."""
    from pdserve.services.router.client import AsyncClient, GenerationFailed

    status, body = post(dep, {"prompt": ["hi"] * 17, "max_tokens": 2})
    assert status == 400 and body["error"]["code"] == "too_many_prompts", body

    async def main() -> tuple[list[Any], Any]:
        async with AsyncClient(dep.cfg.front_address, timeout=120) as greedy, \
                AsyncClient(dep.cfg.front_address, timeout=120) as other:  # fmt: skip
            many = [
                asyncio.create_task(greedy.generate(prompt_token_ids=PROMPT + [k], max_tokens=4))
                for k in range(PER_CLIENT + 4)
            ]
            # refusals come at once; the admitted ones wait for the held pulls
            refused, _ = await asyncio.wait(many, timeout=2.0)
            mine = asyncio.create_task(other.generate(prompt_token_ids=PROMPT, max_tokens=4))
            await asyncio.sleep(0.5)
            hostile_hold.unlink()  # the held ones pull, decode, finish
            results = await asyncio.gather(*many, return_exceptions=True)
            assert len(refused) == 4, results
            return results, await mine

    hostile_hold.touch()  # decode pulls nothing: the admitted requests stay in flight
    try:
        results, mine = asyncio.run(main())
    finally:
        hostile_hold.unlink(missing_ok=True)
    failed = [r for r in results if isinstance(r, GenerationFailed)]
    assert len(failed) == 4 and all(f.reason == "overloaded" for f in failed), results
    assert all("its share" in f.message for f in failed)
    assert sum(1 for r in results if not isinstance(r, BaseException)) == PER_CLIENT
    assert len(mine.token_ids) == 4
    still_serving(dep)
    add_row(
        hostile_report,
        dep,
        "17-prompt batch; one client sending 12 with a share of 8",
        14,
        14,
        "400 too_many_prompts; 8 served, 4 overloaded at once; the other client served",
    )


def test_the_sdk_notices_a_frozen_router_within_its_heartbeat(
    hostile_report: FaultReport, dep: Deployment
) -> None:
    """Issue item 4: after a router stall the SDK reconnected and replies went to the old
    identity: streams with timeout=None never ended. Now a dropped connection fails what
    was in flight at once, within the ZMTP heartbeat timeout."""
    from pdserve.services.router.client import GenerationFailed

    router = dep.procs["router"].pid
    with client(dep) as c:
        stream = c.stream(prompt_token_ids=PROMPT, max_tokens=400, ignore_eos=True,
                          timeout=None)  # fmt: skip
        next(stream)
        os.kill(router, signal.SIGSTOP)
        stopped = time.monotonic()
        try:
            with pytest.raises(GenerationFailed) as info:
                for _ in stream:
                    pass
        finally:
            took = time.monotonic() - stopped
            os.kill(router, signal.SIGCONT)
    assert info.value.reason == "unreachable" and "dropped" in info.value.message, info.value
    bound = (HEARTBEAT_TIMEOUT_MS + 2 * HEARTBEAT_IVL_MS) / 1000
    assert f"{HEARTBEAT_TIMEOUT_MS / 1000:g} s" in info.value.message
    wait_until(lambda: router_metrics(dep)["pdserve:loop_stalls_total"] >= 1, bound,
               "the router to count its own stall")  # fmt: skip
    still_serving(dep)
    add_row(
        hostile_report,
        dep,
        "SIGSTOP of the router mid-stream (SDK timeout=None)",
        1,
        1,
        "Failed unreachable (connection dropped); router resumed, counted its stall",
        round(took, 2),
        bound,
    )
