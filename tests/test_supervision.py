"""`pdserve up` supervises each service on its own, as systemd does each unit: a service
that exits with a failure starts again after a backoff (restart_seconds doubling up to
restart_max_seconds), forever, and the others keep serving (issue 40: a decode whose port
another process held failed 6 times, then `up` stopped the healthy router and prefill
too). Why a service is down is reported: a line, the router's /health and /metrics."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from pdserve.cli import deployment as d
from pdserve.cli.port_owner import port_holder, port_of
from pdserve.cli.supervisor import restart_delay
from pdserve.common.runtime import supervision
from pdserve.common.runtime.service_config import load_config
from tests.e2e import deployment
from tests.fault_tools import wait_until
from tests.test_serving import metrics, post, total

pytestmark = pytest.mark.slow  # starts processes

FIRST, CAP = 0.5, 2.0  # restart_seconds, restart_max_seconds: short, so the tests are


class Crashing(d.Deployment):
    """A deployment whose one process exits with ``code`` at once, every time (a real
    process)."""

    def __init__(self, tmp_path: Path, code: int) -> None:
        cfg = load_config(None, security={"insecure": True}, restart_seconds=FIRST,
                          restart_max_seconds=CAP)  # fmt: skip
        super().__init__(cfg, tmp_path)
        self.code = code

    def roles(self) -> list[tuple[str, list[str]]]:
        return [("decode-0", ["decode"])]

    def _spawn(self, name: str, args: list[str], env: dict[str, str], log_mode: str) -> None:
        self.log_path(name).write_text("the last words\n")
        self.procs[name] = subprocess.Popen([sys.executable, "-c", f"exit({self.code})"])
        self.procs[name].wait()


def crashing(tmp_path: Path, code: int = 1) -> Crashing:
    dep = Crashing(tmp_path, code)
    dep.start()
    return dep


def test_a_failing_service_is_restarted_with_backoff_forever(tmp_path: Path) -> None:
    assert [restart_delay(n, FIRST, CAP) for n in (1, 2, 3, 4, 100)] == [0.5, 1, 2, 2, 2]
    dep = crashing(tmp_path)
    step = 0.125  # simulated time in exact binary steps: no rounding at the boundaries
    start = now = float(int(time.monotonic()))
    when = []
    while now < start + 30:  # restarts every CAP s at most, never a stop
        if any(e.startswith("started decode-0 again") for e in dep.supervise(now=now)):
            when.append(now)
        now += step
    gaps = [b - a for a, b in zip(when, when[1:], strict=False)]
    # each wait is the backoff from the moment the exit was seen (a step after the start)
    assert gaps[:2] == [1 + step, 2 + step] and set(gaps[1:]) == {2 + step}, gaps
    assert len(when) > 6  # past systemd's old StartLimitBurst=5, and `up`'s
    report = supervision.read_report(dep.cfg.supervisor_file)
    assert report is not None
    svc = report.services["decode-0"]
    assert svc.state == "restarting" and svc.num_restarts == len(when)
    assert svc.cause == "exit code 1; last log line: the last words", svc.cause
    down = supervision.health_detail(dep.cfg.supervisor_file)["decode-0"]
    assert down["state"] == "restarting" and 0 <= down["next_start_seconds"] <= CAP
    samples = {s.name: s for s in supervision.metric_samples(dep.cfg.supervisor_file)}
    assert samples["pdserve:service_restarts"].value == len(when)
    assert samples["pdserve:service_down"].value == 1
    assert samples["pdserve:service_down"].labels["service"] == "decode"
    # A life as long as the cap counts as served: the next failure waits FIRST again.
    for _ in range(int(CAP / step) + 2):  # up to the next start
        if any(e.startswith("started") for e in dep.supervise(now=now)):
            break
        now += step
    events = dep.supervise(now=now + CAP)  # its exit, seen CAP s after its start
    assert len(events) == 1 and f"again in {FIRST:g} s (failure 1 in a row" in events[0], events


def test_a_clean_exit_or_config_error_is_not_restarted(tmp_path: Path) -> None:
    dep = crashing(tmp_path, 2)
    events = dep.supervise()
    assert len(events) == 1 and "code 2 (a configuration error): not restarting" in events[0]
    assert "the other services keep serving" in events[0]
    assert dep.supervise(now=time.monotonic() + 100) == []  # never started again
    down = supervision.health_detail(dep.cfg.supervisor_file)["decode-0"]
    assert down["state"] == "stopped" and "exit code 2" in down["cause"]


def test_a_report_that_cannot_be_written_is_told_once_and_supervision_goes_on(
    tmp_path: Path,
) -> None:
    dep = crashing(tmp_path)
    assert dep.supervisor is not None
    dep.supervisor.report_path = tmp_path / "removed" / "supervision.json"
    now = time.monotonic()
    first = dep.supervise(now=now)
    assert len(first) == 2 and "could not write the supervision report" in first[1], first
    later = dep.supervise(now=now + CAP) + dep.supervise(now=now + CAP + 0.1)
    assert later[0].startswith("started decode-0 again") and len(later) == 2, later


@contextmanager
def squatted(address: str) -> Iterator[socket.socket]:
    """Another process's listener on ``address``'s port (here: this test's)."""
    with socket.socket() as sock:
        # SO_REUSEADDR: the killed service's connections linger in TIME_WAIT on the port
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", port_of(address) or 0))
        sock.listen(1)
        yield sock


def health(url: str) -> tuple[int, dict[str, Any]]:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=10) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def test_a_decode_whose_port_is_held_does_not_stop_the_others(
    tmp_path: Path, model_dir: Path
) -> None:
    with deployment(tmp_path, model_dir, restart_seconds=FIRST, restart_max_seconds=1.0) as dep:
        address = dep.cfg.decode_addresses[0].address
        others = {name: dep.procs[name].pid for name in ("router", "prefill-0")}
        dep.kill("decode-0")
        with squatted(address):
            assert port_holder(address) == f"{address} is in use by pid {os.getpid()} " + (
                f"({Path('/proc/self/comm').read_text().strip()})"
            )

            def failures() -> int:
                dep.supervise()
                report = supervision.read_report(dep.cfg.supervisor_file)
                return report.services["decode-0"].num_failures if report else 0

            # 6 failed starts in a row: where `up` used to stop the whole deployment
            wait_until(lambda: failures() >= 6, 60, "decode-0 to fail to start 6 times")
            status, body = health(dep.url)
            assert status == 503, body
            down = body["detail"]["decode-0"]
            assert not down["ready"] and down["supervisor"]["state"] == "restarting", down
            cause = down["supervisor"]["cause"]
            assert f"{address} is in use by pid {os.getpid()}" in cause, cause
            assert "Address already in use" in cause, cause  # its last log line
            assert body["detail"]["prefill-0"]["ready"], body
            assert {n: dep.procs[n].pid for n in others} == others
            assert all(dep.procs[n].poll() is None for n in others)
            snap = metrics(dep.url)
            assert total(snap, "pdserve:service_down", "decode") == 1
            assert total(snap, "pdserve:service_restarts_total", "decode") >= 5
        # The port is free: decode comes back at its next try and serves.
        wait_until(lambda: (dep.supervise(), health(dep.url)[0] == 200)[1], 60, "decode back")
        assert {n: dep.procs[n].pid for n in others} == others
        status, answer = post(dep.url, "/v1/completions",
                              {"prompt": "Hello", "max_tokens": 2, "temperature": 0})  # fmt: skip
        assert status == 200 and answer["usage"]["completion_tokens"] == 2, answer
        assert total(metrics(dep.url), "pdserve:service_down") == 0
