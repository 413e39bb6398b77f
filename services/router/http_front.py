"""The HTTP front door's connections: what one client, or all of them, can hold open.

aiohttp's server reads a request's headers with no deadline (a connection that sends
``POST / HTTP/1.1\\r\\nHost: x\\r\\nContent-Le`` and then nothing is kept forever) and
accepts until the process runs out of file descriptors, when /health, chat and the ZMQ
front door fail alike. ``GuardedSite`` listens in aiohttp's ``TCPSite``'s place and puts
a ``_Guard`` in front of each connection's aiohttp handler:

- a connection over ``max_connections_per_client`` from its address, or over
  ``max_connections`` in all, is answered ``503`` with ``Retry-After`` (a few bytes
  written to the socket's buffer, no handler made) and closed once the client has read
  it (what it sends meanwhile dropped, LINGER_SECONDS at most);
- a request's headers not received whole within ``header_timeout`` of the connection's
  start are answered ``408`` and the connection closed. Until they are, the connection
  has no aiohttp handler (nor its task): the bytes wait in the guard. Past the first request, aiohttp's
  ``keepalive_timeout`` (set by the runner) closes a connection idle, or stalled in its
  next request's headers, that long after its last answer; a stalled body is
  ``body_read_timeout_seconds``' (http_errors.read_body).

``max_connections`` 0 derives the cap from the process's file-descriptor limit
(RLIMIT_NOFILE, its soft limit first raised to the hard one), leaving ``FD_RESERVE`` descriptors to everything else (ZMQ, the
tokenizer process, files), so the cap is reached before the limit is.
"""

from __future__ import annotations

import asyncio
import json
import resource
from collections import Counter
from dataclasses import dataclass
from typing import Any, cast

import structlog
from aiohttp import web

log = structlog.get_logger("pdserve.router.http")

FD_RESERVE = 1024  # descriptors kept for what is not an HTTP connection
MAX_HEAD_BYTES = 65536  # a request's headers buffered here at most (aiohttp's are 8 KB a line)
LINGER_SECONDS = 1.0  # a refused connection read (and dropped) this long before closing
MAX_LINGERING = 256  # refused connections lingering at once, within FD_RESERVE
_END_OF_HEADERS = b"\r\n\r\n"


@dataclass(frozen=True)
class ConnectionLimits:
    header_timeout: float = 15.0  # seconds to receive a request's headers
    max_connections: int = 0  # open HTTP connections in all; 0: derived from RLIMIT_NOFILE
    max_connections_per_client: int = 1024  # open HTTP connections per client address

    def total(self) -> int:
        if self.max_connections:
            return self.max_connections
        return derived_max_connections()


def raise_fd_limit() -> int:
    """The soft RLIMIT_NOFILE raised to the hard one (a shell's 1024 would cap the HTTP
    front door at 512 connections where the system allows far more); the soft limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):  # not allowed here: keep the soft limit
            pass
    return soft


def derived_max_connections() -> int:
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        soft = 1 << 20
    return max(64, soft - FD_RESERVE if soft > 2 * FD_RESERVE else soft // 2)


def _refusal(status: int, reason: str, message: str, code: str, retry_after: bool) -> bytes:
    """A whole HTTP/1.1 answer in OpenAI's error shape, closing the connection."""
    body = json.dumps(
        {
            "error": {
                "message": message,
                "type": "service_unavailable_error" if status == 503 else "timeout_error",
                "param": None,
                "code": code,
            }
        }  # fmt: skip
    ).encode()
    head = (
        f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n"
        + ("Retry-After: 1\r\n" if retry_after else "")
        + "\r\n"
    )
    return head.encode() + body


class ConnectionTable:
    """The open connections, in all and per client address."""

    def __init__(self, limits: ConnectionLimits) -> None:
        self.limits = limits
        self.max_total = limits.total()
        self.total = 0
        self.by_address: Counter[str] = Counter()
        self.refused = 0  # connections answered 503 (a cap)
        self.timed_out = 0  # connections closed for their headers' deadline
        self.lingering = 0  # refused connections answered and not yet closed

    def admit(self, address: str) -> str | None:
        """None: admitted (counted); else why not."""
        if self.by_address[address] >= self.limits.max_connections_per_client:
            return (f"this client address has {self.by_address[address]} connections open, "
                    f"the most one may (max_connections_per_client); close some or retry")  # fmt: skip
        if self.total >= self.max_total:
            return (f"the server has {self.total} connections open, the most it takes "
                    "(max_connections); retry")  # fmt: skip
        self.total += 1
        self.by_address[address] += 1
        return None

    def release(self, address: str) -> None:
        self.total -= 1
        self.by_address[address] -= 1
        if self.by_address[address] <= 0:
            del self.by_address[address]


class _Guard(asyncio.Protocol):
    """One connection: admitted or refused, its first request's headers timed, then every
    event handed to aiohttp's handler."""

    def __init__(self, server: web.Server, table: ConnectionTable,
                 loop: asyncio.AbstractEventLoop) -> None:  # fmt: skip
        self._server = server
        self._table = table
        self._loop = loop
        self._inner: asyncio.Protocol | None = None
        self._address: str | None = None
        self._transport: asyncio.Transport | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._head = bytearray()  # what came before the first request's headers ended
        self._lingering = False  # refused: answered, closing once the client has read it

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport = cast(asyncio.Transport, transport)  # uvloop's is no asyncio subclass
        self._transport = transport
        peer = transport.get_extra_info("peername")
        address = str(peer[0]) if isinstance(peer, tuple) and peer else str(peer)
        why = self._table.admit(address)
        if why is not None:
            self._table.refused += 1
            transport.write(_refusal(503, "Service Unavailable", why, "too_many_connections", True))
            self._linger(transport)
            return
        self._address = address
        # aiohttp's handler (a task of its own) is made once the headers are in: until
        # then a connection costs this object and a timer
        self._timer = self._loop.call_later(self._table.limits.header_timeout, self._too_slow)

    def _linger(self, transport: asyncio.Transport) -> None:
        """Close after the answer, reading (and dropping) what the client still sends for
        up to LINGER_SECONDS: a socket closed with unread data is reset, and a reset can
        discard the answer before the client reads it. Past MAX_LINGERING such sockets
        at once, closed at once (the answer may then be lost to a reset)."""
        table = self._table
        if table.lingering >= MAX_LINGERING:
            transport.close()
            return
        table.lingering += 1
        self._lingering = True
        if transport.can_write_eof():
            transport.write_eof()  # FIN after the answer: the client reads it, then EOF
        self._loop.call_later(LINGER_SECONDS, transport.close)

    def _too_slow(self) -> None:
        self._timer = None
        if self._transport is None or self._transport.is_closing():
            return
        self._table.timed_out += 1
        seconds = self._table.limits.header_timeout
        self._transport.write(_refusal(408, "Request Timeout", f"the request's headers were not "
                                       f"received within {seconds:g} s "
                                       "(http_header_timeout_seconds); the connection is closed",
                                       "header_timeout", False))  # fmt: skip
        self._transport.close()

    def data_received(self, data: bytes) -> None:
        if self._inner is not None:
            self._inner.data_received(data)
            return
        if self._timer is None or self._transport is None:  # refused, or timed out
            return
        start = max(0, len(self._head) - 3)
        self._head += data
        if _END_OF_HEADERS not in self._head[start:] and len(self._head) <= MAX_HEAD_BYTES:
            return  # more to come (past MAX_HEAD_BYTES aiohttp refuses the lines as too long)
        self._timer.cancel()
        self._timer = None
        head, self._head = bytes(self._head), bytearray()
        self._inner = self._server()
        self._inner.connection_made(self._transport)
        self._inner.data_received(head)

    def eof_received(self) -> bool | None:
        return self._inner.eof_received() if self._inner is not None else None  # None: close

    def pause_writing(self) -> None:
        if self._inner is not None:
            self._inner.pause_writing()

    def resume_writing(self) -> None:
        if self._inner is not None:
            self._inner.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._lingering:
            self._lingering = False
            self._table.lingering -= 1
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._address is not None:
            self._table.release(self._address)
            self._address = None
        if self._inner is not None:
            self._inner.connection_lost(exc)
            self._inner = None


class GuardedSite(web.TCPSite):
    """aiohttp's TCPSite with every connection behind a ``_Guard`` of one table."""

    def __init__(self, runner: web.BaseRunner, host: str | None, port: int,
                 limits: ConnectionLimits, **kwargs: Any) -> None:  # fmt: skip
        super().__init__(runner, host, port, **kwargs)
        self.limits = limits
        self.table = ConnectionTable(limits)

    async def start(self) -> None:
        await web.BaseSite.start(self)  # registers the site with the runner
        raise_fd_limit()
        self.table = ConnectionTable(self.limits)  # the cap of the raised limit
        loop = asyncio.get_running_loop()
        server = self._runner.server
        assert server is not None
        table = self.table

        def guard() -> _Guard:
            return _Guard(server, table, loop)

        self._server = await loop.create_server(
            guard, self._host, self._port, backlog=self._backlog,
            reuse_address=self._reuse_address, reuse_port=self._reuse_port,
        )  # fmt: skip
        sockets = self._server.sockets
        self._bound_port = sockets[0].getsockname()[1] if sockets else self._port
        log.info("http_connection_limits", header_timeout=table.limits.header_timeout,
                 max_connections=table.max_total,
                 max_connections_per_client=table.limits.max_connections_per_client)  # fmt: skip
