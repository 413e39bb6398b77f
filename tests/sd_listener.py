"""systemd's side of the notify protocol (common/runtime/sd_notify.py) for tests that start
services as their ``Type=notify`` units do: a filesystem-path AF_UNIX datagram socket per
service (a path, not an abstract name: paths are seen from every network namespace of a
tests/netns_hosts.py lab, abstract names are not), read by one thread that keeps every
datagram with the time it arrived.

:meth:`NotifyListener.env` is what systemd puts in a unit's environment: ``NOTIFY_SOCKET``
and ``WATCHDOG_USEC``; ``WATCHDOG_PID`` (the unit's main process) is set by
:func:`with_watchdog_pid`, since only the started process knows its pid.
"""

from __future__ import annotations

import selectors
import socket
import threading
import time
from collections.abc import Iterable
from itertools import pairwise
from pathlib import Path


def with_watchdog_pid(argv: list[str]) -> list[str]:
    """``argv`` run with ``WATCHDOG_PID`` set to its own pid, as systemd sets it: a shell
    exports its ``$$`` and execs ``argv``, which keeps that pid."""
    return ["sh", "-c", 'WATCHDOG_PID=$$ exec "$@"', "sh", *argv]


class NotifyListener:
    """One notify socket per service name under ``directory``; ``watchdog_seconds`` is the
    ``WatchdogSec=`` the services are told (``WATCHDOG_USEC``)."""

    def __init__(self, directory: Path, names: Iterable[str], watchdog_seconds: float) -> None:
        self.watchdog_seconds = watchdog_seconds
        self._lock = threading.Lock()
        self._received: dict[str, list[tuple[float, str]]] = {}
        self._selector = selectors.DefaultSelector()
        self._paths: dict[str, Path] = {}
        for name in names:
            path = directory / f"{name}.sock"
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            sock.bind(str(path))
            sock.setblocking(False)
            self._selector.register(sock, selectors.EVENT_READ, name)
            self._paths[name] = path
            self._received[name] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._read, name="sd-notify", daemon=True)
        self._thread.start()

    def env(self, name: str) -> dict[str, str]:
        return {
            "NOTIFY_SOCKET": str(self._paths[name]),
            "WATCHDOG_USEC": str(int(self.watchdog_seconds * 1e6)),
        }

    def _read(self) -> None:
        while not self._stop.is_set():
            for key, _ in self._selector.select(0.2):
                sock: socket.socket = key.fileobj  # type: ignore[assignment]
                while True:
                    try:
                        data = sock.recv(4096)
                    except BlockingIOError:
                        break
                    with self._lock:
                        self._received[key.data].append((time.monotonic(), data.decode()))

    def times(self, name: str, field: str) -> list[float]:
        """When each datagram of ``name`` holding ``field`` (``READY=1``) arrived."""
        with self._lock:
            return [t for t, text in self._received[name] if field in text.split("\n")]

    def longest_silence(self, name: str, start: float, end: float | None = None) -> float:
        """The longest time within [start, end] (end: now) since ``name``'s last
        ``WATCHDOG=1`` (or since ``start``, where none came before it: a service that just
        sent READY=1): what systemd compares with ``WatchdogSec=``."""
        end = time.monotonic() if end is None else end
        pings = self.times(name, "WATCHDOG=1")
        last = max((t for t in pings if t <= start), default=start)
        marks = [last, *(t for t in pings if start < t <= end), end]
        return max(b - a for a, b in pairwise(marks))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        for key in list(self._selector.get_map().values()):
            key.fileobj.close()  # type: ignore[union-attr]
        self._selector.close()
        for path in self._paths.values():
            path.unlink(missing_ok=True)
