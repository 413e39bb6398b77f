"""cli/zygote.py: `pdserve up`'s services are forked from a zygote that imported their code
once. A child reports its exit code as a Popen would, writes to its own log, names its
role and instance on its command line (as its rank processes do), and no service outlives
a killed launcher (they get SIGTERM and drain, as under PR_SET_PDEATHSIG before)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pdserve.cli.service_process import zygote_for
from tests.e2e import deployment
from tests.fault_tools import rank_pids

pytestmark = pytest.mark.slow  # real processes

ROOT = Path(__file__).resolve().parent.parent


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] == "Z"


def title(pid: int) -> str:
    """The command line ``ps -eo args`` shows (setproctitle pads it with NULs)."""
    return Path(f"/proc/{pid}/cmdline").read_bytes().rstrip(b"\0").decode()


def test_exit_codes_and_logs_read_as_popen(tmp_path: Path) -> None:
    env = dict(os.environ)
    zyg = zygote_for(env)
    # variables read only at run time need no zygote of their own
    assert zygote_for({**env, "PDSERVE_LOG_LEVEL": "debug", "PYTEST_CURRENT_TEST": "x"}) is zyg
    log = tmp_path / "bad.log"
    bad = zyg.spawn(
        "bad", ["router", "--config", str(tmp_path / "none.toml")], env, str(log), False
    )
    assert bad.wait(120) == 2 and bad.poll() == 2
    assert "cannot read config file" in log.read_text()
    # the same zygote again, appending to the log; a signal is -N as in Popen
    again = zyg.spawn("bad", ["router", "--config", "/"], env, str(log), True)
    assert again.pid != bad.pid and again.wait(60) == 2
    assert log.read_text().count("pdserve: error") == 2
    with pytest.raises(subprocess.TimeoutExpired):
        slow = zyg.spawn("slow", ["generate", "--prompt", "x"], env, str(tmp_path / "s.log"), False)
        slow.wait(0.01)
    slow.kill()
    assert slow.wait(30) == -signal.SIGKILL


LAUNCHER = """
import json, sys, time
from pathlib import Path
sys.path.insert(0, sys.argv[3])
from tests.e2e import deployment
dep = deployment(Path(sys.argv[1]), Path(sys.argv[2]))
dep.start()
dep.wait_ready()
print(json.dumps({name: p.pid for name, p in dep.procs.items()}), flush=True)
time.sleep(600)
"""


def test_a_killed_launcher_leaves_no_service_behind(tmp_path: Path, model_dir: Path) -> None:
    launcher = subprocess.Popen(
        [sys.executable, "-c", LAUNCHER, str(tmp_path / "d"), str(model_dir), str(ROOT)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert launcher.stdout is not None
        pids = json.loads(launcher.stdout.readline())
        assert set(pids) == {"prefill-0", "decode-0", "router"}
        for name, pid in pids.items():
            assert title(pid) == f"pdserve-{name}"
        launcher.kill()
        launcher.wait()
        deadline = time.monotonic() + 30
        while not all(gone(pid) for pid in pids.values()) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert all(gone(pid) for pid in pids.values()), pids
        logs = {name: (tmp_path / "d" / f"{name}.log").read_text() for name in pids}
        # each was told to stop (SIGTERM) and drained, none was killed mid-step
        assert "router_draining" in logs["router"]
        assert all("service_draining" in logs[name] for name in ("prefill-0", "decode-0"))
    finally:
        launcher.kill()
        launcher.wait()


def test_services_and_ranks_name_their_role_and_instance(tmp_path: Path, model_dir: Path) -> None:
    """``ps -eo args`` tells them apart: not the zygote's or the forkserver's command line,
    nor prctl's name cut to 15 characters (``pdserve-prefill``)."""
    with deployment(tmp_path, model_dir, pcp=2, decode_tp=2) as dep:
        assert {name: title(p.pid) for name, p in dep.procs.items()} == {
            "prefill-0": "pdserve-prefill-0",
            "decode-0": "pdserve-decode-0",
            "router": "pdserve-router",
        }
        for name in ("prefill-0", "decode-0"):
            ranks = sorted(title(pid) for pid in rank_pids(dep.procs[name].pid))
            assert ranks == [f"pdserve-{name}-rank0", f"pdserve-{name}-rank1"]
