"""Issue 49, fair to every client down to the engines: the pure cores (the router's
FairQueue, the scheduler's waiting line) under a mocked backlog, priority beating arrival
at both levels; the slow tests: an aborted long prompt stops its chunks (engine on the
tiny model), and a second client's request is not stuck behind a first client's backlog
through a real deployment (counted in requests, never in seconds)."""

from __future__ import annotations

import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from pdserve.common.engine.block_pool import BlockPool
from pdserve.common.engine.request import Request, Status
from pdserve.common.engine.sampling import SamplingParams
from pdserve.common.engine.scheduler import Scheduler
from pdserve.services.router.fair_queue import FairQueue

B = 4  # block size of the pure scheduler tests


def scheduler(max_seqs: int, budget: int = 64, num_blocks: int = 256) -> Scheduler:
    return Scheduler(BlockPool(num_blocks), B, max_seqs, budget)


def step(s: Scheduler, max_tokens: int, admitted: list[Request]) -> None:
    """One step with a fake sampler; the requests admitted this step appended in order."""
    plan, chosen = s.schedule()
    assert plan.seqs, "no progress"
    admitted += [r for r in chosen if r not in admitted]
    s.on_step_done(chosen, plan)
    for seq, req in zip(plan.seqs, chosen, strict=True):
        if seq.sample:
            req.output_token_ids.append(7)
            if len(req.output_token_ids) >= max_tokens:
                s.finish(req, "length")


def backlog(s: Scheduler, demand: dict[str, int], prompt: int = 8) -> list[Request]:
    """Each client's requests, added client after client (the first's backlog first)."""
    reqs = []
    order = 0
    for client, num in demand.items():
        for k in range(num):
            req = Request(f"{client}{k}", list(range(prompt)), SamplingParams(max_tokens=4),
                          order, client=client)  # fmt: skip
            order += 1
            s.add(req)
            reqs.append(req)
    return reqs


# -- the engines' waiting line ------------------------------------------------------------


def test_the_waiting_line_serves_clients_by_tokens_computed_not_arrival() -> None:
    """Three clients with unequal demand (40, 8, 3 requests of 12 tokens each), the big
    one's backlog queued first: while each has work waiting, the tokens computed for them
    stay within a few requests' worth of each other (first come, first served would
    compute 40 of the first's before any of the others'), and every request ends."""
    s = scheduler(max_seqs=2)
    reqs = backlog(s, {"big": 40, "mid": 8, "small": 3})
    admitted: list[Request] = []
    per_request = 8 + 4  # prompt + output tokens
    spreads = []
    while s.has_unfinished:
        step(s, 4, admitted)
        waiting = {r.client for r in s.waiting}
        if len(waiting) > 1:
            spreads.append(max(s.served[c] for c in waiting) - min(s.served[c] for c in waiting))
    assert all(r.status is Status.FINISHED for r in reqs)
    assert spreads and max(spreads) <= 2 * per_request, max(spreads)
    first = [r.client for r in admitted[:9]]
    # small's 3 and mid's first ones ran among the first 9, not after big's 40
    assert Counter(first)["small"] == 3 and Counter(first)["big"] <= 3, first
    # big alone at the end, in its own order
    tail = [r.request_id for r in admitted if r.client == "big"]
    assert tail == [f"big{k}" for k in range(40)]


def test_a_newly_active_client_starts_at_the_lowest_active_counter() -> None:
    """VTC's lift: a client arriving after another was served alone for a while gets the
    same counter, not 0 (else it would take every seat until it caught up)."""
    s = scheduler(max_seqs=1)
    backlog(s, {"old": 6})
    admitted: list[Request] = []
    for _ in range(10):
        step(s, 4, admitted)
    assert s.served["old"] > 0
    late = Request("late0", list(range(8)), SamplingParams(max_tokens=4), 100, client="late")
    late1 = Request("late1", list(range(8)), SamplingParams(max_tokens=4), 101, client="late")
    s.add(late)
    s.add(late1)
    assert s.served["late"] == s.served["old"]
    while s.has_unfinished:
        step(s, 4, admitted)
    order = [r.client for r in admitted]
    start = order.index("late")
    # they alternate from then on instead of late running both back to back first
    assert order[start : start + 4] in (["late", "old", "late", "old"],
                                        ["late", "old", "old", "late"]), order  # fmt: skip


def test_one_client_alone_is_served_first_come_first_served() -> None:
    s = scheduler(max_seqs=2)
    backlog(s, {"only": 7})
    admitted: list[Request] = []
    while s.has_unfinished:
        step(s, 4, admitted)
    assert [r.request_id for r in admitted] == [f"only{k}" for k in range(7)]


def test_priority_beats_arrival_and_counters_in_the_engine() -> None:
    s = scheduler(max_seqs=1)
    first = Request("first", list(range(8)), SamplingParams(max_tokens=2), 0, client="a")
    s.add(first)
    admitted: list[Request] = []
    step(s, 2, admitted)  # a has been served; b has not
    s.add(Request("b0", list(range(8)), SamplingParams(max_tokens=2), 1, client="b"))
    s.add(Request("a-urgent", list(range(8)), SamplingParams(max_tokens=2), 2, client="a",
                  priority=-1))  # fmt: skip
    s.add(Request("b-late", list(range(8)), SamplingParams(max_tokens=2), 3, client="b",
                  priority=5))  # fmt: skip
    while s.has_unfinished:
        step(s, 2, admitted)
    assert [r.request_id for r in admitted] == ["first", "a-urgent", "b0", "b-late"]


# -- the router's dispatch slots ----------------------------------------------------------


def test_router_slots_go_by_tokens_served_and_converge() -> None:
    """Two clients' backlogs at the router, one with requests 4x as long: slots go to the
    one served fewer tokens, so both are served about as many tokens while both wait
    (turns by request count would serve the long one 4x the tokens)."""
    q = FairQueue(slots=2)
    size = {"long": 400, "short": 100}
    running = []
    for k in range(30):
        for owner in ("long", "short"):
            key = f"{owner}{k}"
            if q.join(owner, key):
                q.serve(owner, size[owner])
                running.append(key)
    spreads = []
    while running:
        done = running.pop(0)
        owner = done.rstrip("0123456789")
        for key in q.leave(owner, done):
            granted = key.rstrip("0123456789")
            q.serve(granted, size[granted])
            running.append(key)
        if q.num_waiting_of("long") and q.num_waiting_of("short"):
            spreads.append(abs(q.served["long"] - q.served["short"]))
    assert spreads and max(spreads) <= 2 * size["long"], max(spreads)
    assert (q.num_running, q.num_waiting) == (0, 0)


def test_router_priority_beats_arrival_and_a_newcomer_is_lifted() -> None:
    q = FairQueue(slots=1)
    assert q.join("a", "a0")
    q.serve("a", 1000)
    assert not q.join("a", "a1")
    assert not q.join("a", "a2", priority=-1)  # later, more urgent
    assert not q.join("b", "b0", priority=1)  # a fresh client, but less urgent
    assert q.served["b"] == 1000  # lifted to the lowest active counter, not 0
    assert q.leave("a", "a0") == ["a2"]
    assert q.leave("a", "a2") == ["a1"]
    assert q.leave("a", "a1") == ["b0"]


# -- the engine: an aborted prompt stops its chunks ----------------------------------------


@pytest.mark.slow
def test_an_aborted_long_prompt_stops_its_chunks(model_dir: Path) -> None:
    """A 512-token prompt in 64-token chunks, aborted after two: no third chunk is
    computed, and the 128 tokens computed are counted as abandoned."""
    from pdserve.common.engine.config import EngineConfig
    from pdserve.common.engine.llm_engine import LLMEngine

    engine = LLMEngine(EngineConfig(model=str(model_dir), max_num_batched_tokens=64,
                                    kv_cache_memory_gb=0.25))  # fmt: skip
    engine.add_request("long", list(range(1, 513)), SamplingParams(max_tokens=4))
    engine.step()
    engine.step()
    assert engine.scheduler.num_computed_tokens == 128
    out = engine.abort("long")
    assert out is not None and out.finish_reason == "abort"
    while engine.has_unfinished:
        engine.step()
    engine.step()
    assert engine.scheduler.num_computed_tokens == 128  # no chunk after the abort
    assert engine.scheduler.num_abandoned_tokens == 128


# -- through a real deployment -------------------------------------------------------------

# The busy client: 48 requests at once from its own process and SDK connection.
BUSY = """
import asyncio, json, sys
from pdserve.services.router.client import AsyncClient

async def main():
    async with AsyncClient(sys.argv[1], timeout=300) as client:
        await asyncio.gather(*(client.generate(prompt_token_ids=[1 + k] * 40, max_tokens=8,
                                               ignore_eos=True) for k in range(48)))
    print("done", flush=True)

asyncio.run(main())
"""


@pytest.mark.slow
def test_a_second_clients_request_is_not_stuck_behind_anothers_backlog(
    tmp_path: Path, model_dir: Path
) -> None:
    """The router lets one client hold every dispatch slot here (max_dispatched_per_client
    = the window of 16, 2 decode seats), so the busy client's backlog reaches the engines'
    waiting lines and fairness there is what is tested: the other client's requests (from
    another connection) go before the busy client's queued ones at the router (VTC) and in
    decode's and prefill's waiting lines. Counted in requests: while one of them is in
    flight, the busy client finishes a few of its own, not the 14 queued before it."""
    from pdserve.services.router.client import Client
    from tests.e2e import deployment
    from tests.fault_tools import wait_until
    from tests.hostile_tools import router_metrics

    settings: dict[str, Any] = {
        "max_dispatched_requests": 16,
        "max_dispatched_per_client": 16,
    }
    with deployment(tmp_path, model_dir, engine={"max_num_seqs": 2}, **settings) as dep:
        with Client(dep.cfg.front_address, timeout=120) as other:
            other.generate(prompt_token_ids=[5] * 8, max_tokens=2)  # warm
            busy = subprocess.Popen([sys.executable, "-c", BUSY, dep.cfg.front_address],
                                    stdout=subprocess.PIPE, text=True)  # fmt: skip
            try:
                wait_until(lambda: router_metrics(dep)["pdserve:num_requests_running"] >= 40,
                           60, "the busy client's backlog in flight")  # fmt: skip
                passed = []
                for k in range(3):
                    before = router_metrics(dep)["pdserve:requests_total"]
                    out = other.generate(prompt_token_ids=[9 + k] * 8, max_tokens=4,
                                         ignore_eos=True)  # fmt: skip
                    assert len(out.token_ids) == 4
                    passed.append(router_metrics(dep)["pdserve:requests_total"] - before - 1)
            finally:
                assert busy.stdout is not None
                done = busy.stdout.read()
                busy.wait(120)
        text = metrics_text(dep.url)
    print(f"busy client's requests finished while each short one was in flight: {passed}")
    assert "done" in done
    # Behind the busy client's 16 dispatched (14 of them queued in the engines), a short
    # request sees ~all 16 finish first (16, 16, 16 with the engines' lines first come,
    # first served; 6, 2, 4 with them fair).
    assert max(passed) < 10, passed
    # per client class: one each for the two connections, every token served counted
    served = [line for line in text if line.startswith("pdserve:client_served_tokens_total{")]
    assert len(served) == 2, served
    # 48 x (40 + 8) for the busy client, 8 + 2 + 3 x (8 + 4) for the other
    assert sorted(float(line.rsplit(" ", 1)[1]) for line in served) == [46.0, 2304.0], served
    assert sum(line.startswith("pdserve:client_queue_seconds_count{") for line in text) == 2
    abandoned = [line for line in text if line.startswith("pdserve:abandoned_tokens_total{")]
    assert all(any(f'service="{s}"' in line for line in abandoned)
               for s in ("prefill", "decode")), abandoned  # fmt: skip


def metrics_text(url: str) -> list[str]:
    import urllib.request

    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as resp:
        return resp.read().decode().splitlines()


# -- the HTTP API's fields ------------------------------------------------------------------

from tests import http_fakes  # noqa: E402
from tests.http_fakes import FakeCore, request  # noqa: E402

server_core, core, port, tokenizer = (
    http_fakes.server_core,
    http_fakes.core,
    http_fakes.port,
    http_fakes.tokenizer,
)


def test_priority_and_a_trusted_user_reach_the_core(port: int, core: FakeCore) -> None:
    """vLLM's ``priority`` is passed on; ``user`` names the client only when the
    deployment trusts it (else every user behind one address would be one client, and
    anyone could claim to be many when trusted by default)."""
    body = {"prompt": "hi", "max_tokens": 1, "user": "alice", "priority": -2}
    assert request(port, "POST", "/v1/completions", body)[0] == 200
    core.trust_user_field = True
    try:
        assert request(port, "POST", "/v1/completions", body)[0] == 200
        assert request(port, "POST", "/v1/completions", {**body, "user": "bob"})[0] == 200
    finally:
        del core.trust_user_field
    assert core.owners[0] == "http:127.0.0.1"
    assert core.owners[1:] == ["user:alice", "user:bob"]
    assert [g.priority for g in core.submitted] == [-2, -2, -2]
    status, _, _ = request(port, "POST", "/v1/completions", {**body, "priority": "high"})
    assert status == 400


# -- per-client limits ----------------------------------------------------------------------


def test_one_client_leaves_decode_seats_free_and_per_client_limits_apply(tokenizer: Any) -> None:
    from pdserve.common.errors import PdserveError
    from pdserve.common.runtime.service_config import DeploymentConfig
    from pdserve.services.router.router import Router

    default = DeploymentConfig()  # 64 decode seats: 72 dispatched, one client 56
    assert (default.dispatch_window, default.client_dispatch_share) == (72, 56)
    assert DeploymentConfig(max_dispatched_per_client=8).client_dispatch_share == 8
    assert DeploymentConfig(max_dispatched_requests=900).client_dispatch_share == 800
    with pytest.raises(PdserveError, match="max_queued_per_client"):
        DeploymentConfig(max_queued_per_client=-1)

    from pdserve.common.runtime.instance_config import SecurityConfig

    cfg = DeploymentConfig(max_dispatched_requests=1, max_queued_per_client=2,
                           security=SecurityConfig(insecure=True))  # fmt: skip
    router = Router(cfg, tokenizer, "m", 64, 100)
    assert router.admission.join("a", "a0")
    assert not router.admission.join("a", "a1")
    assert router._refusal("a") is None or router._refusal("a")[0] != "overloaded"
    assert not router.admission.join("a", "a2")
    refusal = router._refusal("a")
    assert refusal is not None and refusal[0] == "overloaded"
    assert "max_queued_per_client" in refusal[1]
    other = router._refusal("b")  # another client is not refused for a's queue
    assert other is None or other[0] != "overloaded"


def test_the_sdk_sends_priority_apart_from_sampling() -> None:
    from pdserve.common.errors import RequestError
    from pdserve.services.router.client_common import build_request

    gen = build_request("hi", None, None, None, True, {"priority": -1, "max_tokens": 3})
    assert gen.priority == -1 and gen.sampling.max_tokens == 3
    assert build_request("hi", None, None, None, True, {}).priority == 0
    with pytest.raises(RequestError, match="priority must be an int"):
        build_request("hi", None, None, None, True, {"priority": "high"})
