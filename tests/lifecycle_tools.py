"""What the lifecycle tests (tests/test_lifecycle.py, test_lifecycle_router.py) share:
the manager's end of a real $NOTIFY_SOCKET, a service started as systemd would start it,
its colocated config, and its exit code within a bound.
"""

from __future__ import annotations

import json
import os
import queue
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest

from pdserve.common.runtime.ports import free_port_block
from pdserve.common.runtime.service_config import DeploymentConfig, load_config

PROMPT = [1, 504, 3458, 282, 4649, 314]  # token ids: no tokenizer needed to send them


class Notifications(threading.Thread):
    """The manager's end of $NOTIFY_SOCKET: an abstract AF_UNIX datagram socket, read
    all the time as systemd does (the kernel queues only ~10 unread datagrams)."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.address = f"@pdserve-test-{uuid.uuid4().hex}"
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind("\0" + self.address[1:])
        self.fields: queue.Queue[str] = queue.Queue()
        self.seen: list[str] = []
        self.closed = threading.Event()
        self.sock.settimeout(0.2)
        self.start()

    def run(self) -> None:
        while not self.closed.is_set():
            try:
                datagram = self.sock.recv(4096).decode()
            except TimeoutError:
                continue
            for field in datagram.split("\n"):
                self.fields.put(field)

    def wait_for(
        self, field: str, proc: subprocess.Popen[bytes], timeout: float = 300.0
    ) -> list[str]:
        """Every field received since the last call, up to and including ``field``."""
        deadline = time.monotonic() + timeout
        start = len(self.seen)
        while time.monotonic() < deadline:
            assert proc.poll() is None, f"the service exited with {proc.returncode} before {field}"
            try:
                self.seen.append(self.fields.get(timeout=0.5))
            except queue.Empty:
                continue
            if self.seen[-1] == field:
                return self.seen[start:]
        raise AssertionError(f"no {field} within {timeout} s; got {self.seen}")

    def close(self) -> None:
        self.closed.set()
        self.join(5)
        self.sock.close()


def start(
    tmp: Path,
    role: str,
    cfg: DeploymentConfig,
    notifications: Notifications,
    watchdog_usec: int = 0,
) -> subprocess.Popen[bytes]:
    config = tmp / f"{role}.json"
    config.write_bytes(json.dumps(msgspec.to_builtins(cfg)).encode())
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PDSERVE_", "WATCHDOG_"))}
    env.update(
        {k: v for k, v in os.environ.items() if k in ("PDSERVE_CACHE_DIR", "PDSERVE_KERNELS")}
    )
    env["NOTIFY_SOCKET"] = notifications.address
    if watchdog_usec:
        env["WATCHDOG_USEC"] = str(watchdog_usec)
    args = [role] if role == "router" else [role, "--instance", "0"]
    with open(tmp / f"{role}.log", "wb") as log:  # the child keeps its own descriptor
        return subprocess.Popen([sys.executable, "-m", "pdserve", *args, "--config", str(config)],
                                stdout=log, stderr=subprocess.STDOUT, env=env)  # fmt: skip


def config(model_dir: Path, **flags: Any) -> DeploymentConfig:
    base = free_port_block(100)
    return load_config(
        None,
        model=str(model_dir),
        base_port=base,
        http_port=base + 99,
        torch_threads=1,
        colocated=True,
        engine={"kv_cache_memory_gb": 0.1, "max_model_len": 512},
        **flags,
    )


def stopped(proc: subprocess.Popen[bytes], timeout: float = 60.0) -> int | None:
    """The exit code within ``timeout``; else None, and the process is killed."""
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        return None


@pytest.fixture(name="notifications")
def notifications_fixture() -> Iterator[Notifications]:
    n = Notifications()
    yield n
    n.close()
