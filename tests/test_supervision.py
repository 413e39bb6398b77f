"""`pdserve up` restarts a dead service as systemd would: at once the first time, then
with an exponential backoff, and not past START_LIMIT_BURST restarts in a window (issue
19: a service crashing on every message was restarted with no pause, then the whole
deployment stopped after the sixth crash)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from pdserve.cli import deployment as d
from pdserve.common.errors import PdserveError
from pdserve.common.runtime.service_config import load_config

pytestmark = pytest.mark.slow  # starts (tiny) processes


class Crashing(d.Deployment):
    """A deployment whose one process exits 1 at once, every time (a real process)."""

    def roles(self) -> list[tuple[str, list[str]]]:
        return [("decode-0", ["decode"])]

    def _spawn(self, name: str, args: list[str], env: dict[str, str], log_mode: str) -> None:
        self.procs[name] = subprocess.Popen([sys.executable, "-c", "raise SystemExit(1)"])
        self.procs[name].wait()


def test_restarts_back_off_and_stop_at_the_start_limit(tmp_path: Path) -> None:
    dep = Crashing(load_config(None, security={"insecure": True}), tmp_path)
    dep.start()
    assert d.restart_delay(0) == 0 and d.restart_delay(1) == d.RESTART_BACKOFF_S
    assert d.restart_delay(2) == 2 * d.RESTART_BACKOFF_S
    assert d.restart_delay(100) == d.RESTART_BACKOFF_MAX_S
    now, when = 1000.0, []
    with pytest.raises(PdserveError) as info:
        for _ in range(10_000):  # bounded: the start limit raises long before
            if dep.restart_failed(now=now):
                when.append(now)
            now += 0.1
    assert len(when) == d.START_LIMIT_BURST
    gaps = [round(b - a, 1) for a, b in zip(when, when[1:], strict=False)]
    # each wait is the backoff from the moment the exit was seen (0.1 s after the restart)
    assert gaps == [round(d.restart_delay(n) + 0.1, 1) for n in range(1, d.START_LIMIT_BURST)]
    assert "start limit" in str(info.value) and "decode-0" in str(info.value)


def test_a_clean_exit_or_config_error_is_not_restarted(tmp_path: Path) -> None:
    class Stopped(Crashing):
        def _spawn(self, name: str, args: list[str], env: dict[str, str], log_mode: str) -> None:
            (self.log_dir / f"{name}.log").write_text("bad config\n")
            self.procs[name] = subprocess.Popen([sys.executable, "-c", "raise SystemExit(2)"])
            self.procs[name].wait()

    dep = Stopped(load_config(None, security={"insecure": True}), tmp_path)
    dep.start()
    with pytest.raises(PdserveError, match="exited with code 2"):
        dep.restart_failed()
