"""The deployment the issue-19 tests share (tests/test_hostile.py, test_hostile_router.py):
the default of `pdserve up` (internal CURVE with keys made at start), short liveness
settings, small per-client share, decode pulls held while a file exists. One per session."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pdserve.cli.deployment import Deployment
from pdserve.common.runtime.curve import CurveKeys
from pdserve.common.runtime.fault_hooks import HOLD_PULLS_ENV
from tests.e2e import deployment
from tests.fault_tools import (
    FaultReport,
    FaultRow,
    pools_full,
    report_path,
    service_metrics,
    wait_until,
)

FIRST_TOKEN_TIMEOUT = 6.0
PER_CLIENT = 8
FAST = {
    "first_token_timeout_seconds": FIRST_TOKEN_TIMEOUT,
    "max_requests_per_client": PER_CLIENT,
    "max_prompts_per_request": 16,
    "ping_seconds": 0.5,
    "peer_timeout_seconds": 3.0,
    "lease_seconds": 3.0,
    "heartbeat_seconds": 0.5,
    "drain_seconds": 2.0,
}
LEASE_BOUND = 3.0 + 0.5 + 5.0
PROMPT = [1, 504, 3458, 282, 4649, 30, 13617, 28, 17212, 28]


@pytest.fixture(scope="session")
def hostile_hold(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("hold") / "hold-pulls"


@pytest.fixture(scope="session")
def hostile_dep(
    tmp_path_factory: pytest.TempPathFactory, model_dir: Path, hostile_hold: Path
) -> Iterator[Deployment]:
    """Registered in tests/conftest.py; test modules alias it as ``dep``."""
    # security={}: the default of `pdserve up` (internal CURVE with keys made at start)
    env = {HOLD_PULLS_ENV: str(hostile_hold)}
    tmp = tmp_path_factory.mktemp("hostile")
    with deployment(tmp, model_dir, env=env, security={}, **FAST) as d:
        yield d


def hostile_json(base: Path) -> Path:
    """Where the hostile rows go: beside the fault suite's table (benchmarks/faults.py)."""
    path = report_path(base)
    return path.with_name(f"{path.stem}-hostile{path.suffix}")


@pytest.fixture(scope="session")
def hostile_report(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[FaultReport]:
    """The attacks' and accidents' rows of the fault table (registered in conftest.py)."""
    rep = FaultReport()
    yield rep
    if not rep.rows:
        return
    path = hostile_json(tmp_path_factory.getbasetemp())
    rep.write(path, {"settings": FAST})
    capture = request.config.pluginmanager.get_plugin("capturemanager")
    with capture.global_and_fixture_disabled():
        print(f"\n\nhostile inputs ({path}):\n{rep.table()}")


def add_row(rep: FaultReport, dep: Deployment, fault: str, requests: int, terminal: int,
            outcome: str, detect: float | None = None, bound: float | None = None) -> None:  # fmt: skip
    """One row, the blocks leaked measured now (after still_serving: the pools settled)."""
    rep.add(FaultRow(fault, 1, requests, terminal, leaked(dep), detect, bound, outcome))


def leaked(dep: Deployment) -> int:
    out = 0
    for address, role in roles(dep):
        m = service_metrics(address, role, keys(dep))
        out += int(m["pdserve:kv_blocks_total"] - m["pdserve:kv_blocks_free"])
    return out


def keys(dep: Deployment) -> CurveKeys:
    """The deployment's own client keys (what an insider, or a bug, would hold)."""
    assert dep.made_keys is not None
    return CurveKeys.client(dep.made_keys)


def roles(dep: Deployment) -> list[tuple[str, str]]:
    return [(dep.cfg.prefill_addresses[0].address, "prefill")] + [
        (dep.cfg.decode_addresses[0].address, "decode")
    ]


def client(dep: Deployment) -> Any:
    from pdserve.services.router.client import Client

    return Client(dep.cfg.front_address, timeout=120)


def router_metrics(dep: Deployment) -> dict[str, float]:
    """The router's own counters and gauges (from /metrics), summed over labels."""
    import urllib.request

    with urllib.request.urlopen(f"{dep.url}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("pdserve:") and 'service="router"' in line:
            name = line.split("{")[0]
            out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def still_serving(dep: Deployment) -> None:
    """Every process alive, a normal request answered, every pool back to full."""
    dep.check_alive()
    dep.wait_ready(60)
    with client(dep) as c:
        assert c.generate(prompt_token_ids=PROMPT, max_tokens=4).token_ids
    wait_until(lambda: pools_full(roles(dep), keys(dep)), LEASE_BOUND, "every KV pool to be full")


def bad_messages(dep: Deployment, address: str, role: str) -> float:
    return service_metrics(address, role, keys(dep))["pdserve:bad_messages"]
