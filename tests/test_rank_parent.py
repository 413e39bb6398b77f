"""common/runtime/parent_watch.py: a child process (a rank, the router's tokenising worker)
ends when the process that started it is killed, even while it is stuck where it never
hears from it (a real child of a real process, SIGKILLed: a rank forked by the service's
forkserver as services/ranks/group.py starts them, the router's spawned worker)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

SERVICE = f"""
import os, sys, time
sys.path.insert(0, {str(ROOT)!r})
from pdserve.services.ranks.group import rank_context
from tests.test_rank_parent import stuck_rank
if __name__ == "__main__":
    proc = rank_context().Process(target=stuck_rank, args=(os.getpid(),), daemon=True)
    proc.start()
    print(proc.pid, flush=True)
    time.sleep(600)
"""


ROUTER = f"""
import asyncio, sys, time
sys.path.insert(0, {str(ROOT)!r})
from pdserve.common.model.checkpoint.files import resolve_model
from pdserve.services.router.tokenize_pool import TokenizePool
if __name__ == "__main__":
    pool = TokenizePool(resolve_model(None))
    asyncio.run(pool.start())
    print(pool.worker_pids()[0], flush=True)
    time.sleep(600)
"""


def stuck_rank(owner: int) -> None:
    """A rank that never reaches its loop (as one waiting in gloo's rendezvous)."""
    from pdserve.common.runtime.parent_watch import exit_with_parent

    exit_with_parent(owner, period=0.1)
    time.sleep(600)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie no one reaps yet is gone too
        return f.read().split(")")[-1].split()[0] != "Z"


@pytest.mark.parametrize("script", [SERVICE, ROUTER], ids=["rank", "tokenize-worker"])
def test_a_child_ends_when_its_parent_is_killed(script: str, model_dir: Path) -> None:
    service = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
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
        assert not _alive(rank), "the child outlived its killed parent"
    finally:
        service.kill()
