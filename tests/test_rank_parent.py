"""services/ranks/process.py: a rank process ends when its service is killed, even while it
is stuck before its serving loop (a real spawn child of a real process, SIGKILLed)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

SERVICE = f"""
import multiprocessing as mp, sys, time
sys.path.insert(0, {str(ROOT)!r})
from tests.test_rank_parent import stuck_rank
if __name__ == "__main__":
    proc = mp.get_context("spawn").Process(target=stuck_rank, daemon=True)
    proc.start()
    print(proc.pid, flush=True)
    time.sleep(600)
"""


def stuck_rank() -> None:
    """A rank that never reaches its loop (as one waiting in gloo's rendezvous)."""
    from pdserve.services.ranks.process import exit_with_parent

    exit_with_parent(period=0.1)
    time.sleep(600)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie no one reaps yet is gone too
        return f.read().split(")")[-1].split()[0] != "Z"


def test_a_rank_ends_when_its_service_is_killed() -> None:
    service = subprocess.Popen([sys.executable, "-c", SERVICE], stdout=subprocess.PIPE, text=True)
    try:
        assert service.stdout is not None
        rank = int(service.stdout.readline())
        time.sleep(1.0)  # the rank is up and waiting
        assert _alive(rank)
        service.send_signal(signal.SIGKILL)
        service.wait(timeout=10)
        deadline = time.monotonic() + 10
        while _alive(rank) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(rank), "the rank outlived its killed service"
    finally:
        service.kill()
