"""pdserve across hosts (issue #41): the router, two prefill and two decode instances each on
a host of its own (Linux network namespaces on one bridge, tests/netns_hosts.py), started
as the systemd units start them, CURVE on, NIXL over UCX's TCP transport. The happy path
first; then faults between hosts under load: a partition between a prefill and the decode
hosts mid-pull, the router cut off from a decode host, SIGSTOP and SIGKILL of a service,
and an abort storm. Each checks that every accepted request got one terminal answer within
its deadline, that the pools are back at their idle counts, that the healthy side serves
meanwhile and that the separated instance rejoins without a restart. The figures go into
docs/operations.md ("Across hosts").
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pdserve.common.engine.config import EngineConfig
from pdserve.common.engine.llm_engine import LLMEngine
from pdserve.common.engine.sampling_params import SamplingParams
from pdserve.common.runtime.fault_hooks import HOLD_PULLS_ENV
from pdserve.common.runtime.service_config import DeploymentConfig
from tests.fault_suite import FAST, SLACK
from tests.fault_tools import wait_until
from tests.multihost import MultiHost
from tests.netns_hosts import Lab, unavailable

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(unavailable() is not None, reason=f"{unavailable()}"),
]

READY_TIMEOUT = 180.0
DEADLINE = 20.0  # the router's first-token deadline here: every request ends within it
SETTINGS: dict[str, Any] = {
    **FAST,
    "kv_load_failure_policy": "fail",  # decode-1 overrides it: recompute (its env file)
    "first_token_timeout_seconds": DEADLINE,
    "ucx": {"UCX_TLS": "tcp"},
    "engine": {"kv_cache_memory_gb": 0.25},
}
if "local_prefill_threshold" in DeploymentConfig.__struct_fields__:
    SETTINGS["local_prefill_threshold"] = 0  # every prompt crosses hosts through a prefill


def prompts(tokenizer: Any) -> list[list[int]]:
    texts = [
        "The days of the week are Monday, Tuesday,",
        "Once upon a time, in a land far away, there lived",
        "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
        " ".join(f"item {i}," for i in range(40)),  # more than one KV block
    ]
    return [tokenizer.encode(t) for t in texts]


@pytest.fixture(scope="module")
def hold_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("hold") / "hold-pulls"


@pytest.fixture(scope="module")
def hosts(
    tmp_path_factory: pytest.TempPathFactory, model_dir: Path, hold_path: Path
) -> Iterator[MultiHost]:
    work = tmp_path_factory.mktemp("multihost")
    held = {HOLD_PULLS_ENV: str(hold_path)}
    env = {"decode-0": held, "decode-1": {**held, "PDSERVE_KV_LOAD_FAILURE_POLICY": "recompute"}}
    with Lab() as lab:
        dep = MultiHost(lab, work, model_dir, 2, 2, SETTINGS, env)
        dep.start()
        dep.wait_ready(READY_TIMEOUT)
        yield dep


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> tuple[list[list[int]], list[list[int]]]:
    """The prompts and their greedy tokens from the monolithic engine in this process."""
    mono = LLMEngine(EngineConfig(model=str(model_dir), kv_cache_memory_gb=0.1))
    ids = prompts(mono.tokenizer)
    outs = mono.generate(ids, SamplingParams(max_tokens=8))
    return ids, [o.token_ids for o in outs]


def counter(text: str, name: str, **labels: str) -> float:
    """Sum of a /metrics counter's samples whose labels include ``labels``."""
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name):
            continue
        head, _, value = line.rpartition(" ")
        if all(f'{k}="{v}"' in head for k, v in labels.items()):
            total += float(value)
    return total


def test_greedy_across_hosts_is_the_monolithic_engines(
    hosts: MultiHost, reference: tuple[list[list[int]], list[list[int]]]
) -> None:
    ids, want = reference
    before = hosts.metrics_text()
    futures = [hosts.submit(p, max_tokens=8) for p in ids * 3]
    results = [f.result(timeout=120) for f in futures]
    assert [r.token_ids for r in results] == want * 3
    after = hosts.metrics_text()
    # Every instance served: a prefill's KV was released by a decode on another host, a
    # decode pulled KV.
    for role, name in (("prefill", "pdserve:kv_replica_releases_total"),
                       ("decode", "pdserve:kv_transfers_total")):  # fmt: skip
        for i in range(2):
            now = counter(after, name, service=role, instance=str(i))
            assert now > counter(before, name, service=role, instance=str(i)), (role, i)
    pulled = counter(after, "pdserve:kv_transfer_bytes_total") - counter(
        before, "pdserve:kv_transfer_bytes_total"
    )
    print(f"KV pulled over UCX TCP: {pulled:.0f} bytes for {len(futures)} requests")
    assert pulled > 0
    wait_until(hosts.pools_idle, SLACK, "every pool back at its idle count")


def test_prefix_hits_are_routed_to_the_prefill_that_holds_them(hosts: MultiHost) -> None:
    base = list(range(1000, 1000 + 200))  # three full blocks shared
    first = hosts.generate(base + [7, 8, 9], max_tokens=2)
    again = hosts.generate(base + [10, 11], max_tokens=2)
    assert not isinstance(first, Exception) and not isinstance(again, Exception)
    assert again.usage.cached_tokens >= 192, again.usage


def test_ucx_and_bind_settings_reached_the_services(hosts: MultiHost) -> None:
    """decode-1 binds every interface and advertises its address; NIXL's UCX ran TCP."""
    log = hosts.log_path("decode-1").read_text()
    assert '"UCX_TLS": "tcp"' in log, log[-2000:]
    status, detail = hosts.health()
    assert status == 200, detail
