"""Faults on every edge, on real processes: kill -9 a decode mid-pull, a prefill rank
mid-prefill, a prefill between its answer and the pull, the router; corrupt a handle;
restart a producer; and a storm of requests cut short by their clients. Each must end
every request with exactly one terminal reply naming what failed, within its bound, and
leave every KV pool full. The bounds are the ones docs/operations.md ("Faults") gives
for this suite's settings; every wait is bounded. A table of the faults is printed and
written to $PDSERVE_FAULTS_JSON (benchmarks/faults.py keeps it in benchmarks/results/).
The prefill rank's death is in tests/test_faults_prefill_rank.py; the settings, helpers
and the table's fixture in tests/fault_suite.py.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest

from pdserve.cli.deployment import Deployment
from pdserve.common.runtime import protocol as p
from pdserve.common.runtime.fault_hooks import HOLD_PULLS_ENV
from tests.e2e import deployment
from tests.fault_storm import storm
from tests.fault_suite import (
    DETECT_BOUND,
    FAST,
    LEASE,
    LEASE_BOUND,
    PROMPT,
    addresses,
    client,
    decode_waiting,
    decode_with,
    failure_of,
    handle_for,
    health,
    in_background,
    leaked,
    prefill_peer,
    restart,
    transfer_failures,
)
from tests.fault_tools import (
    FaultReport,
    FaultRow,
    pools_full,
    service_metrics,
    wait_until,
)
from tests.test_serving import metrics, total

pytestmark = pytest.mark.slow


# -- one prefill, one decode: killed, restarted, lied to ---------------------------------------


@pytest.fixture(scope="module")
def carry() -> dict[str, Any]:
    """What one test hands the next (a handle from a producer life that ended)."""
    return {}


@pytest.fixture(scope="module")
def hold_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("hold") / "hold-pulls"


@pytest.fixture
def hold(hold_path: Path) -> Iterator[Path]:
    """While this file exists, decode starts no pull (HOLD_PULLS_ENV); never left behind."""
    yield hold_path
    hold_path.unlink(missing_ok=True)


@pytest.fixture(scope="module")
def dep(
    tmp_path_factory: pytest.TempPathFactory, model_dir: Path, hold_path: Path
) -> Iterator[Deployment]:
    with deployment(
        tmp_path_factory.mktemp("faults"), model_dir, env={HOLD_PULLS_ENV: str(hold_path)}, **FAST
    ) as d:
        yield d


def test_wrong_descriptors_fail_the_request_and_are_counted(
    dep: Deployment, fault_report: FaultReport
) -> None:
    done = handle_for(dep, "forged-1", PROMPT)
    n = done.handle.layout.num_blocks
    forged = msgspec.structs.replace(done.handle, block_ids=[b + n for b in done.handle.block_ids])
    before = transfer_failures(dep)
    started = time.monotonic()
    replies = decode_with(dep, done, PROMPT, forged)
    seconds = time.monotonic() - started
    end = replies[-1]
    assert isinstance(end, p.Failed) and end.reason == "kv_transfer" and "outside" in end.message, (
        end
    )
    assert "prefill-0" in end.message
    assert transfer_failures(dep) == before + 1
    # The failed pull still released the producer: its blocks are free at once.
    wait_until(
        lambda: pools_full(addresses(dep)), 10, "the producer to free the forged request's blocks"
    )
    fault_report.add(
        FaultRow(
            "wrong KV descriptors (policy fail)",
            1,
            1,
            1,
            leaked(dep),
            round(seconds, 2),
            None,
            "Failed kv_transfer; kv_transfer_failures +1; producer released at once",
        )
    )


def test_prefill_killed_before_the_pull_fails_the_request(
    dep: Deployment, hold: Path, carry: dict[str, Any], fault_report: FaultReport
) -> None:
    with client(dep) as c:  # decode has met this producer life (no handshake left to do)
        assert c.generate(prompt_token_ids=PROMPT, max_tokens=2).token_ids
    carry["old"] = handle_for(dep, "old-epoch", PROMPT)  # pinned in this producer life
    hold.touch()
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        fut = in_background(pool, dep, PROMPT, max_tokens=6)
        wait_until(lambda: decode_waiting(dep), 30, "decode to hold the pull")
        killed = time.monotonic()
        dep.kill("prefill-0")
        hold.unlink()
        err = failure_of(fut, DETECT_BOUND)
        failed_in = time.monotonic() - killed
    assert err.reason == "kv_transfer" and "prefill-0" in err.message, err
    # The router stopped routing to the dead instance: a new request fails at once.
    wait_until(
        lambda: health(dep).get("detail", {}).get("prefill-0", {}).get("ready") is False,
        DETECT_BOUND,
        "prefill-0 marked down",
    )
    with client(dep) as c, pytest.raises(Exception, match="no prefill instance is up"):
        c.generate(prompt_token_ids=PROMPT, max_tokens=2)
    up_in = restart(dep, "prefill-0")
    fault_report.add(
        FaultRow(
            "kill -9 of prefill after its answer, before the pull (policy fail)",
            1,
            2,
            2,
            leaked(dep),
            round(failed_in, 2),
            DETECT_BOUND,
            f"Failed kv_transfer naming prefill-0; next request refused peer_down; back in {up_in:.1f} s",
        )
    )


def test_a_restarted_producer_refuses_old_handles(
    dep: Deployment, carry: dict[str, Any], fault_report: FaultReport
) -> None:
    old = carry.get("old")
    assert old is not None, "runs after the producer was killed and restarted"
    with client(dep) as c:  # decode meets the new epoch (and forgets the old one)
        assert c.generate(prompt_token_ids=PROMPT, max_tokens=2).token_ids
    replies = decode_with(dep, old, PROMPT, old.handle)
    end = replies[-1]
    assert (
        isinstance(end, p.Failed) and end.reason == "kv_transfer" and "stale epoch" in end.message
    ), end
    # A handle of an epoch decode never met is refused by the producer at the handshake.
    done = handle_for(dep, "older", PROMPT)
    older = msgspec.structs.replace(done.handle, epoch=done.handle.epoch - 1)
    end2 = decode_with(dep, done, PROMPT, older)[-1]
    assert isinstance(end2, p.Failed) and "it restarted" in end2.message, end2
    with prefill_peer(dep) as peer:  # nobody will pull it: the abort frees it at once
        peer.send(p.Abort(request_id="older"))
    wait_until(lambda: pools_full(addresses(dep)), 10, "the aborted request's blocks to be free")
    fault_report.add(
        FaultRow(
            "producer restarted: old handles used",
            2,
            2,
            2,
            leaked(dep),
            None,
            None,
            "Failed kv_transfer: 'stale epoch' (decode) and 'it restarted' (producer handshake)",
        )
    )


def test_decode_killed_mid_pull_frees_the_producer_at_lease_expiry(
    dep: Deployment, hold: Path, fault_report: FaultReport
) -> None:
    prefill = dep.cfg.prefill_addresses[0].address
    expired = service_metrics(prefill, "prefill")["pdserve:kv_expired_requests"]
    hold.touch()
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        fut = in_background(pool, dep, PROMPT, max_tokens=6)
        wait_until(lambda: decode_waiting(dep), 30, "decode to hold the pull")
        time.sleep(LEASE)  # heartbeats keep the lease past its first deadline
        assert service_metrics(prefill, "prefill")["pdserve:kv_expired_requests"] == expired
        killed = time.monotonic()
        dep.kill("decode-0")
        err = failure_of(fut, DETECT_BOUND)
        failed_in = time.monotonic() - killed
    hold.unlink()
    assert err.reason == "peer_down" and "decode-0" in err.message, err
    wait_until(
        lambda: service_metrics(prefill, "prefill")["pdserve:kv_expired_requests"] == expired + 1,
        LEASE_BOUND,
        "the lease to expire",
    )
    freed_in = time.monotonic() - killed
    assert freed_in <= LEASE_BOUND
    wait_until(lambda: pools_full([(prefill, "prefill")]), 5, "the producer's pool to be full")
    # Back with kv_load_failure_policy = recompute for the next test.
    up_in = restart(dep, "decode-0", PDSERVE_KV_LOAD_FAILURE_POLICY="recompute")
    with client(dep) as c:
        assert c.generate(prompt_token_ids=PROMPT, max_tokens=2).token_ids
    fault_report.add(
        FaultRow(
            "kill -9 of decode mid-pull",
            1,
            1,
            1,
            leaked(dep),
            round(failed_in, 2),
            DETECT_BOUND,
            f"Failed peer_down naming decode-0; lease expired, blocks freed {freed_in:.1f} s after the kill "
            f"(bound {LEASE_BOUND:g}); back in {up_in:.1f} s",
        )
    )


def test_recompute_policy_gives_the_same_tokens(
    dep: Deployment, hold: Path, fault_report: FaultReport
) -> None:
    with client(dep) as c:
        want = c.generate(prompt_token_ids=PROMPT, max_tokens=6).token_ids
    before = transfer_failures(dep)
    # Wrong descriptors, recomputed.
    done = handle_for(dep, "forged-2", PROMPT)
    forged = msgspec.structs.replace(
        done.handle, block_ids=[b + done.handle.layout.num_blocks for b in done.handle.block_ids]
    )
    replies = decode_with(dep, done, PROMPT, forged)
    assert isinstance(replies[-1], p.Finished), replies[-1]
    assert [t for r in replies if isinstance(r, p.TokenChunk) for t in r.token_ids] == want
    # The producer killed before the pull, recomputed.
    hold.touch()
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        fut = in_background(pool, dep, PROMPT, max_tokens=6)
        wait_until(lambda: decode_waiting(dep), 30, "decode to hold the pull")
        killed = time.monotonic()
        dep.kill("prefill-0")
        hold.unlink()
        got = fut.result(timeout=DETECT_BOUND + 30)  # recomputing takes a prefill on decode
        answered_in = time.monotonic() - killed
    assert got.token_ids == want
    assert transfer_failures(dep) == before + 2
    up_in = restart(dep, "prefill-0")
    wait_until(lambda: pools_full(addresses(dep)), 10, "every pool to be full")
    fault_report.add(
        FaultRow(
            "wrong descriptors + kill -9 of prefill before the pull (policy recompute)",
            2,
            2,
            2,
            leaked(dep),
            round(answered_in, 2),
            None,
            f"same tokens as without faults; kv_transfer_failures +2; prefill back in {up_in:.1f} s",
        )
    )


def test_a_dead_router_has_its_work_aborted(
    dep: Deployment, hold: Path, fault_report: FaultReport
) -> None:
    from pdserve.services.router.client import AsyncClient

    decode, prefill = dep.cfg.decode_addresses[0].address, dep.cfg.prefill_addresses[0].address
    expired = service_metrics(prefill, "prefill")["pdserve:kv_expired_requests"]

    async def scenario() -> float:
        async with AsyncClient(dep.cfg.front_address) as c:
            long = [
                asyncio.create_task(
                    c.generate(prompt_token_ids=PROMPT + [k], max_tokens=2000, ignore_eos=True)
                )
                for k in range(2)
            ]
            await asyncio.to_thread(
                wait_until,
                lambda: service_metrics(decode, "decode")["pdserve:num_requests_running"] >= 2,
                60,
                "two decodes running",
            )
            hold.touch()
            held = asyncio.create_task(c.generate(prompt_token_ids=PROMPT + [9], max_tokens=4))
            await asyncio.to_thread(wait_until, lambda: decode_waiting(dep), 30, "a pull held")
            killed = time.monotonic()
            dep.kill("router")
            await asyncio.to_thread(
                wait_until,
                lambda: pools_full(addresses(dep)),
                DETECT_BOUND,
                "the services to abort the dead router's requests",
            )
            seconds = time.monotonic() - killed
            for t in [*long, held]:
                t.cancel()
            await asyncio.gather(*long, held, return_exceptions=True)
            return seconds

    freed_in = asyncio.run(scenario())
    hold.unlink()
    assert (
        service_metrics(prefill, "prefill")["pdserve:kv_expired_requests"] == expired
    )  # released, not expired
    assert service_metrics(decode, "decode")["pdserve:router_lost"] >= 1
    up_in = restart(dep, "router")
    with client(dep) as c:
        assert c.generate(prompt_token_ids=PROMPT, max_tokens=2).token_ids
    fault_report.add(
        FaultRow(
            "kill -9 of the router",
            1,
            3,
            0,
            leaked(dep),
            round(freed_in, 2),
            DETECT_BOUND,
            f"services aborted its 3 requests (2 decoding, 1 pull held), every block freed; "
            f"clients of a dead router get no reply (SDK timeout); back in {up_in:.1f} s",
        )
    )


def test_500_requests_with_disconnects_and_aborts(
    dep: Deployment, fault_report: FaultReport
) -> None:
    before = metrics(dep.url)
    result = asyncio.run(storm(dep.cfg.front_address, dep.url, num=500, concurrency=48, seed=6))
    assert not result.violations, result.violations[:10]
    assert result.num_requests == 500
    wait_until(lambda: pools_full(addresses(dep)), 30, "every pool full after the storm")
    after = metrics(dep.url)
    counted = total(after, "pdserve:requests_total") - total(before, "pdserve:requests_total")
    assert counted == 500, (counted, result.outcomes)
    assert total(after, "pdserve:num_requests_running", "router") == 0
    assert total(after, "pdserve:kv_expired_requests_total") == total(
        before, "pdserve:kv_expired_requests_total"
    )
    aborted = sum(n for k, n in result.outcomes.items() if k.endswith(("abort", "left", "gone")))
    fault_report.add(
        FaultRow(
            "500 requests, clients aborting / disconnecting",
            aborted,
            500,
            500,
            leaked(dep),
            None,
            None,
            f"{result.seconds:.0f} s; "
            + ", ".join(f"{k} {n}" for k, n in sorted(result.outcomes.items())),
        )
    )
