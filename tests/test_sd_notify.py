"""common/runtime/sd_notify.py against real AF_UNIX datagram sockets (path and abstract names)."""

from __future__ import annotations

import os
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from pdserve.common.runtime import sd_notify
from pdserve.common.runtime.sd_notify import Watchdog, notify, watchdog_seconds


def _listener(address: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind("\0" + address[1:] if address.startswith("@") else address)
    sock.settimeout(5)
    return sock


@pytest.fixture(params=["path", "abstract"])
def listener(
    request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[socket.socket]:
    address = (
        str(tmp_path / "notify.sock")
        if request.param == "path"
        else f"@pdserve-test-{uuid.uuid4().hex}"
    )
    sock = _listener(address)
    monkeypatch.setenv("NOTIFY_SOCKET", address)
    yield sock
    sock.close()


def _pending(sock: socket.socket) -> list[str]:
    out = []
    sock.setblocking(False)
    try:
        while True:
            out.append(sock.recv(4096).decode())
    except BlockingIOError:
        return out
    finally:
        sock.setblocking(True)


def test_notify_sends_one_datagram_of_fields(listener: socket.socket) -> None:
    assert notify("READY=1", "STATUS=serving")
    assert listener.recv(4096) == b"READY=1\nSTATUS=serving"


def test_without_systemd_notify_is_a_no_op(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    assert not notify("READY=1")


def test_a_vanished_socket_is_reported_not_raised(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("NOTIFY_SOCKET", str(tmp_path / "gone.sock"))
    assert not notify("WATCHDOG=1")


def test_watchdog_seconds_follows_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WATCHDOG_PID", raising=False)
    monkeypatch.delenv("WATCHDOG_USEC", raising=False)
    assert watchdog_seconds() is None
    monkeypatch.setenv("WATCHDOG_USEC", "20000000")
    assert watchdog_seconds() == 20.0
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid()))
    assert watchdog_seconds() == 20.0
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid() + 1))  # meant for another process
    assert watchdog_seconds() is None
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid()))
    monkeypatch.setenv("WATCHDOG_USEC", "0")
    assert watchdog_seconds() is None


def test_watchdog_pings_at_most_once_per_half_timeout(listener: socket.socket) -> None:
    dog = Watchdog(timeout=3600.0)
    for _ in range(100):
        dog.kick()
    assert listener.recv(4096) == b"WATCHDOG=1"
    assert _pending(listener) == []


def test_watchdog_stays_silent_while_the_loop_is_stuck(listener: socket.socket) -> None:
    dog = Watchdog(timeout=1.0, needs_loop=True)
    dog._loop_seen = time.monotonic() - 10  # the asyncio loop last turned 10 s ago
    dog.kick()
    assert _pending(listener) == []
    dog.loop_tick()
    dog.kick()
    assert listener.recv(4096) == b"WATCHDOG=1"


def test_from_env_is_none_without_a_watchdog(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WATCHDOG_USEC", raising=False)
    assert Watchdog.from_env() is None
    monkeypatch.setenv("WATCHDOG_USEC", "500000")
    monkeypatch.delenv("WATCHDOG_PID", raising=False)
    dog = Watchdog.from_env()
    assert dog is not None and dog.interval == 0.25
    assert sd_notify.watchdog_seconds() == 0.5


def test_before_wait_pings_the_process_watchdog_at_once(
    listener: socket.socket, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before a bounded wait on a peer (a KV reconnect), the process's watchdog pings
    within its interval: the wait counts from then; without a watchdog, nothing is sent."""
    monkeypatch.setattr(sd_notify, "_current", None)
    monkeypatch.delenv("WATCHDOG_USEC", raising=False)
    assert Watchdog.from_env() is None
    sd_notify.before_wait()
    assert _pending(listener) == []
    monkeypatch.setenv("WATCHDOG_USEC", str(3600 * 10**6))
    monkeypatch.delenv("WATCHDOG_PID", raising=False)
    dog = Watchdog.from_env()
    assert dog is not None
    dog.kick()
    dog.kick()
    assert _pending(listener) == ["WATCHDOG=1"]
    sd_notify.before_wait()
    assert _pending(listener) == ["WATCHDOG=1"]
    dog.kick()  # the interval counts from the forced ping
    assert _pending(listener) == []


def test_a_manager_that_stops_reading_never_blocks_the_sender(listener: socket.socket) -> None:
    # The kernel queues ~10 datagrams per socket; a blocking send would hang the 11th.
    sent: list[bool] = []
    sender = threading.Thread(
        target=lambda: sent.extend(notify("WATCHDOG=1") for _ in range(200)), daemon=True
    )
    sender.start()
    sender.join(60)
    assert not sender.is_alive() and len(sent) == 200
    assert sent[0] and not sent[-1]  # the overflow is dropped, not queued without bound
