"""What the fault suite's files (tests/test_faults.py, test_faults_prefill_rank.py) share:
its short liveness settings and the bounds that follow from them, the fault table
(``fault_report``, one per session, registered in conftest.py), and the helpers that read
a deployment's health, blocks and failures, and its prefill and decode peers (a handle
from one, a decode fed a handle).
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

from pdserve.cli.deployment import Deployment
from pdserve.common.engine.sampling_params import SamplingParams
from pdserve.common.runtime import protocol as p
from tests.fault_tools import (
    FaultReport,
    Peer,
    report_path,
    service_metrics,
)

# Short liveness settings so the suite stays quick; the bounds scale with them.
PING, PEER_TIMEOUT, LEASE, HEARTBEAT = 0.5, 3.0, 3.0, 0.5
FAST = {
    "ping_seconds": PING,
    "peer_timeout_seconds": PEER_TIMEOUT,
    "lease_seconds": LEASE,
    "heartbeat_seconds": HEARTBEAT,
    "drain_seconds": 2.0,
}
# A dead process's connection drops at once; silence is noticed within PEER_TIMEOUT + PING.
# SLACK absorbs a loaded 2-core machine; these are bounds, not speed measurements.
SLACK = 5.0
DETECT_BOUND = PEER_TIMEOUT + PING + SLACK
LEASE_BOUND = LEASE + HEARTBEAT + SLACK
READY_TIMEOUT = 180.0
PROMPT = [1, 504, 3458, 282, 4649, 30, 13617, 28, 17212, 28]  # a short raw prompt


@pytest.fixture(scope="session")
def fault_report(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[FaultReport]:
    """The fault table of tests/test_faults*.py, written once at the end of the session
    (registered in conftest.py)."""
    rep = FaultReport()
    started = time.monotonic()
    yield rep
    path = report_path(tmp_path_factory.getbasetemp())
    rep.write(
        path,
        {
            "suite_seconds": round(time.monotonic() - started, 1),
            "cpus": os.cpu_count(),
            "load_average": [round(x, 2) for x in os.getloadavg()],
            "ping_seconds": PING,
            "peer_timeout_seconds": PEER_TIMEOUT,
            "lease_seconds": LEASE,
            "heartbeat_seconds": HEARTBEAT,
        },
    )
    capture = request.config.pluginmanager.get_plugin("capturemanager")
    with capture.global_and_fixture_disabled():
        print(f"\n\nfaults injected ({path}):\n{rep.table()}")


def health(dep: Deployment) -> dict[str, Any]:
    try:
        with urllib.request.urlopen(f"{dep.url}/health", timeout=5):
            return {"ok": True}
    except urllib.error.HTTPError as err:
        return json.loads(err.read())


def addresses(dep: Deployment) -> list[tuple[str, str]]:
    return [(a.address, "prefill") for a in dep.cfg.prefill_addresses] + [
        (a.address, "decode") for a in dep.cfg.decode_addresses
    ]


def leaked(dep: Deployment, roles: list[tuple[str, str]] | None = None) -> int:
    out = 0
    for address, role in roles or addresses(dep):
        m = service_metrics(address, role)
        out += int(m["pdserve:kv_blocks_total"] - m["pdserve:kv_blocks_free"])
    return out


def client(dep: Deployment) -> Any:
    from pdserve.services.router.client import Client

    return Client(dep.cfg.front_address, timeout=120)


def in_background(
    pool: concurrent.futures.Executor, dep: Deployment, ids: list[int], **sampling: Any
) -> concurrent.futures.Future[Any]:
    def run() -> Any:
        with client(dep) as c:
            return c.generate(prompt_token_ids=ids, **sampling)

    return pool.submit(run)


def failure_of(fut: concurrent.futures.Future[Any], timeout: float) -> Any:
    from pdserve.services.router.client import GenerationFailed

    with pytest.raises(GenerationFailed) as info:
        fut.result(timeout=timeout)
    return info.value


def decode_waiting(dep: Deployment) -> bool:
    return (
        service_metrics(dep.cfg.decode_addresses[0].address, "decode")[
            "pdserve:num_requests_waiting"
        ]
        >= 1
    )


# -- one deployment's peers: a prefill's handle, a decode fed a handle ---------------------


def restart(dep: Deployment, name: str, **env: str) -> float:
    started = time.monotonic()
    dep.restart(name, env)
    dep.wait_ready(READY_TIMEOUT)
    return time.monotonic() - started


def prefill_peer(dep: Deployment) -> Peer:
    return Peer(dep.cfg.prefill_addresses[0].address, "prefill")


def decode_peer(dep: Deployment) -> Peer:
    return Peer(dep.cfg.decode_addresses[0].address, "decode")


def handle_for(dep: Deployment, rid: str, ids: list[int], max_tokens: int = 6) -> p.PrefillDone:
    with prefill_peer(dep) as peer:
        done = peer.ask(
            p.PrefillRequest(
                request_id=rid,
                trace_id=rid,
                prompt_token_ids=ids,
                sampling=SamplingParams(max_tokens=max_tokens),
            )
        )[-1]
    assert isinstance(done, p.PrefillDone), done
    return done


def decode_with(
    dep: Deployment, done: p.PrefillDone, ids: list[int], handle: p.KVHandle, max_tokens: int = 6
) -> list[Any]:
    msg = p.DecodeRequest(
        request_id=done.request_id,
        trace_id=done.trace_id,
        prompt_token_ids=ids,
        sampling=SamplingParams(max_tokens=max_tokens),
        first_token=done.first_token,
        handle=handle,
    )
    with decode_peer(dep) as peer:
        return peer.ask(msg)


def transfer_failures(dep: Deployment) -> float:
    return service_metrics(dep.cfg.decode_addresses[0].address, "decode")[
        "pdserve:kv_transfer_failures"
    ]
