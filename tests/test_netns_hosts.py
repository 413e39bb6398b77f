"""The multi-host harness itself (tests/netns_hosts.py): a cut is silent and pairwise, a
heal restores it, and a lab that fails leaves no namespace or process behind."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from tests.fault_tools import wait_until
from tests.netns_hosts import Lab, unavailable

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(unavailable() is not None, reason=f"{unavailable()}"),
]
PORT = 7777


def reaches(lab: Lab, source: str, target: str) -> bool:
    def connect() -> bool:
        try:
            socket.create_connection((lab.hosts[target].ip, PORT), timeout=1).close()
            return True
        except OSError:
            return False

    return lab.executor(source, 1).submit(connect).result()


def test_a_cut_is_pairwise_and_healed_and_a_failed_lab_leaves_nothing() -> None:
    listen = (
        "import socket,time; s=socket.socket(); s.bind(('0.0.0.0',%d)); s.listen(); time.sleep(60)"
    )
    with pytest.raises(RuntimeError, match="the test failed"), Lab() as lab:
        for name in ("a", "b", "c"):
            lab.add_host(name)
        servers = [lab.spawn(name, [sys.executable, "-c", listen % PORT], dict(os.environ),
                             subprocess.DEVNULL) for name in ("b", "c")]  # fmt: skip
        wait_until(lambda: reaches(lab, "a", "b") and reaches(lab, "a", "c"), 30, "listeners")
        lab.cut("a", "b")
        assert not reaches(lab, "a", "b") and not reaches(lab, "b", "a")
        assert reaches(lab, "a", "c") and reaches(lab, "b", "c")  # every other pair talks
        lab.heal("a", "b")
        assert reaches(lab, "a", "b")
        raise RuntimeError("the test failed")
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert lab.tag not in names, names
    assert all(proc.poll() is not None for proc in servers)
