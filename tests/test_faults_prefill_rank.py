"""A fault on real processes: kill -9 of a prefill rank mid-prefill (PCP 2). Its instance
fails the request at once and exits, the other instance serves on, every live KV pool
full; a row of the fault table (tests/fault_suite.py; the rest of the suite:
tests/test_faults.py).
"""

from __future__ import annotations

import concurrent.futures
import os
import signal
import time
from pathlib import Path

import pytest

from tests.e2e import deployment
from tests.fault_suite import (
    DETECT_BOUND,
    FAST,
    PROMPT,
    client,
    failure_of,
    health,
    in_background,
    leaked,
)
from tests.fault_tools import (
    FaultReport,
    FaultRow,
    is_gone,
    pools_full,
    rank_pids,
    service_metrics,
    wait_until,
)
from tests.test_serving import metrics, total

pytestmark = pytest.mark.slow


def test_a_dead_prefill_rank_fails_its_instance_fast(
    tmp_path: Path, model_dir: Path, fault_report: FaultReport
) -> None:
    # 63 chunks of 32 tokens: long enough that the rank dies mid-prefill (with 16 chunks of
    # 128 the prefill once ended, and the answer came, before the kill landed)
    def long_prompt(attempt: int) -> list[int]:  # a new prompt each try: no prefix-cache hit
        return [(i * 37 + attempt * 101) % 20_000 + 100 for i in range(2000)]

    with (
        deployment(
            tmp_path,
            model_dir,
            prefill_instances=2,
            pcp=2,
            prefill_engine={"max_num_batched_tokens": 32},
            **FAST,
        ) as dep,
        concurrent.futures.ThreadPoolExecutor(2) as pool,
    ):

        def busy_instance() -> int | None:
            for i, a in enumerate(dep.cfg.prefill_addresses):
                if service_metrics(a.address, "prefill")["pdserve:num_requests_running"] >= 1:
                    return i + 1  # truthy
            return None

        # The kill must land while the prefill runs. On a loaded 2-core CI machine one poll
        # of both instances' metrics can outlast the whole prefill (a fresh-clone CI run saw
        # none running for 60 s), so a prefill that ends unseen is answered (checked) and a
        # new long prompt is sent, a few times at most.
        for attempt in range(4):
            fut = in_background(pool, dep, long_prompt(attempt), max_tokens=4)
            seen = wait_until(
                lambda fut=fut: busy_instance() or ("done" if fut.done() else None),
                60,
                "the long prefill to start or be answered",
            )
            if seen != "done":
                break
            assert fut.result().token_ids, "a long prompt that ended unseen was not answered"
        else:
            pytest.fail("4 long prefills each ended before a poll saw one running")
        victim = int(seen) - 1
        coordinator = dep.procs[f"prefill-{victim}"]
        ranks = rank_pids(coordinator.pid)
        assert len(ranks) == 2, ranks
        killed = time.monotonic()
        os.kill(ranks[1], signal.SIGKILL)
        err = failure_of(fut, DETECT_BOUND)
        failed_in = time.monotonic() - killed
        assert (
            err.reason == "peer_down"
            and f"prefill {victim}" in err.message
            and "rank 1" in err.message
        ), err
        code = wait_until(
            lambda: coordinator.poll() is not None and coordinator.returncode,
            30,
            "the coordinator to exit",
        )
        exited_in = time.monotonic() - killed
        assert code != 0
        wait_until(lambda: all(is_gone(pid) for pid in ranks), 15, "its other rank to exit")
        detail = wait_until(
            lambda: health(dep).get("detail"), 10, "the router to report the instance"
        )
        assert detail[f"prefill-{victim}"]["ready"] is False
        other = 1 - victim
        before = total(metrics(dep.url), "pdserve:kv_replica_releases_total", "prefill")
        with client(dep) as c:
            for k in range(4):
                assert c.generate(prompt_token_ids=PROMPT + [k], max_tokens=3).token_ids
        # a replica's release follows the answer (the decode's ack): wait for all 2 x 4
        wait_until(
            lambda: (
                total(metrics(dep.url), "pdserve:kv_replica_releases_total", "prefill") - before
                >= 4 * 2
            ),
            10,
            "the survivor's replica releases",
        )
        after = metrics(dep.url)
        assert (
            total(after, "pdserve:kv_replica_releases_total", "prefill") - before == 4 * 2
        )  # 2 ranks each, none twice
        live = [
            (dep.cfg.prefill_addresses[other].address, "prefill"),
            (dep.cfg.decode_addresses[0].address, "decode"),
        ]
        wait_until(lambda: pools_full(live), 10, "the live pools to be full")
        fault_report.add(
            FaultRow(
                "kill -9 of a prefill rank mid-prefill (PCP 2)",
                1,
                1,
                1,
                leaked(dep, live),
                round(failed_in, 2),
                DETECT_BOUND,
                f"Failed peer_down; coordinator exited {code} after {exited_in:.1f} s; prefill-{other} served 4/4",
            )
        )
