"""systemd's readiness and watchdog protocol, in pure Python (no libsystemd).

A ``Type=notify`` unit hands its main process ``$NOTIFY_SOCKET``, an AF_UNIX datagram
socket (a path, or an abstract name written with a leading ``@``); each datagram is
newline-separated ``KEY=value`` fields: ``READY=1``, ``STATUS=...``, ``STOPPING=1``,
``WATCHDOG=1``. Outside systemd the variable is unset and every call is a no-op, so the
services call these unconditionally.

Sends never block: the kernel queues only a few datagrams per socket
(``net.unix.max_dgram_qlen``), and a manager that stopped reading must not stall the
engine thread that pings the watchdog. A failed send is logged once and otherwise
ignored: the service keeps serving even if the manager's socket went away.
"""

from __future__ import annotations

import os
import socket
import time

import structlog

log = structlog.get_logger("pdserve.sd_notify")

_warned = False
_current: Watchdog | None = None  # this process's (Watchdog.from_env), for before_wait


def notify(*fields: str) -> bool:
    """Send ``fields`` (e.g. ``"READY=1"``, ``"STATUS=loading"``) as one datagram;
    False when not under systemd or the send failed."""
    global _warned
    address = os.environ.get("NOTIFY_SOCKET", "")
    if not address:
        return False
    if address.startswith("@"):  # abstract namespace: the name starts with a NUL byte
        address = "\0" + address[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.connect(address)
            sock.send("\n".join(fields).encode(), socket.MSG_DONTWAIT)
    except OSError as exc:
        if not _warned:
            _warned = True
            log.warning("sd_notify_failed", socket=os.environ.get("NOTIFY_SOCKET"), error=str(exc))
        return False
    return True


def watchdog_seconds() -> float | None:
    """systemd's watchdog timeout for this process (``WatchdogSec=``), or None when off.

    ``$WATCHDOG_PID``, when set, names the process the timeout is meant for: a child
    that inherited the environment must not ping on its parent's behalf.
    """
    usec = os.environ.get("WATCHDOG_USEC", "")
    pid = os.environ.get("WATCHDOG_PID", "")
    if not usec or (pid and pid != str(os.getpid())):
        return None
    try:
        seconds = int(usec) / 1e6
    except ValueError:
        return None
    return seconds if seconds > 0 else None


class Watchdog:
    """Sends ``WATCHDOG=1`` at most every half timeout, from the loop that must stay alive.

    ``kick`` is cheap (a clock read) and meant to be called on every turn of a busy loop.
    With ``needs_loop`` (prefill and decode, whose engine thread kicks) it also pings only
    while ``loop_tick`` was called within the timeout: a stuck asyncio loop stops the
    pings as surely as a stuck engine step.
    """

    def __init__(self, timeout: float, needs_loop: bool = False) -> None:
        self.timeout = timeout
        self.interval = timeout / 2
        self.needs_loop = needs_loop
        self._last_sent = -float("inf")
        self._loop_seen = time.monotonic()

    @classmethod
    def from_env(cls, needs_loop: bool = False) -> Watchdog | None:
        """The process's watchdog when systemd set one (``before_wait`` then pings it)."""
        global _current
        timeout = watchdog_seconds()
        _current = None if timeout is None else cls(timeout, needs_loop)
        return _current

    def loop_tick(self) -> None:
        self._loop_seen = time.monotonic()

    def kick(self, force: bool = False) -> None:
        """Ping if half the timeout passed since the last ping (``force``: at once)."""
        now = time.monotonic()
        if now - self._last_sent < self.interval and not force:
            return
        if self.needs_loop and now - self._loop_seen > self.timeout:
            return
        self._last_sent = now
        notify("WATCHDOG=1")


def before_wait() -> None:
    """Called by the thread that kicks the watchdog just before it waits on a peer for a
    bounded time (a KV reconnect to an unreachable producer waits out UCX's connect
    timeout): pings this process's watchdog at once, so that the wait counts from a fresh
    ping rather than from up to half a timeout before it. Without this, a ping due just
    as the wait starts comes only after it: the watchdog then needs the wait under half
    its timeout, not under all of it. A wait that never ends still stops the pings."""
    if _current is not None:
        _current.kick(force=True)
