"""The one socket factory: every ZeroMQ socket in pdserve is made here.

It owns the settings that matter for a server: bounded queues (HWM), no linger on close
(a dead peer must not block shutdown), a maximum message size (a hostile or broken peer
cannot make us allocate without bound), ZMTP heartbeats (a silent peer is noticed), and
reconnect back-off, and CURVE (``curve=``: encryption plus authentication of the peer;
see curve.py). Every bound CURVE socket gets its context's ZAP authenticator first.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, TypeVar

import zmq

from pdserve.common.runtime.curve import (
    CurveKeys,
    ensure_authenticator,
    handshake_events,
    monitor_address,
    watch_handshakes,
)

MAX_MESSAGE_BYTES = 64 * 2**20  # a prompt of 1M tokens as msgpack ints is ~5 MB
DEFAULT_HWM = 10_000
HEARTBEAT_IVL_MS = 1_000
HEARTBEAT_TIMEOUT_MS = 5_000


_S = TypeVar("_S", bound=zmq.Socket[Any])


def make_socket(
    ctx: zmq.Context[_S],
    kind: int,
    *,
    bind: str | None = None,
    connect: str | None = None,
    identity: bytes | None = None,
    hwm: int = DEFAULT_HWM,
    max_message_bytes: int = MAX_MESSAGE_BYTES,
    curve: CurveKeys | None = None,
    monitor_events: int = 0,
) -> _S:
    """A configured socket, bound or connected. Works for sync and asyncio contexts
    (an asyncio context's first CURVE server socket needs a running loop).

    ``monitor_events``: the caller reads these events from ``sock.get_monitor_socket()``
    (attached here, before bind/connect, so that no early handshake event is missed; a
    socket has one monitor). With ``curve``, failed handshakes come too: the caller hands
    every event to a ``curve.HandshakeLog``, which logs and counts those."""
    if (bind is None) == (connect is None):
        raise ValueError("make_socket needs exactly one of bind= or connect=")
    if curve is not None and (curve.server_key is None) != (bind is not None):
        raise ValueError("a bound socket takes server CurveKeys, a connected one client CurveKeys")
    if curve is not None and bind is not None:
        ensure_authenticator(ctx, curve)
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, hwm)
    sock.setsockopt(zmq.RCVHWM, hwm)
    sock.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
    sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
    sock.setsockopt(zmq.RECONNECT_IVL, 100)
    sock.setsockopt(zmq.RECONNECT_IVL_MAX, 2_000)
    if kind == zmq.ROUTER:
        # Replies to a peer that went away raise instead of vanishing silently.
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    if identity is not None:
        sock.setsockopt(zmq.IDENTITY, identity)
    if curve is not None:
        curve.apply(sock)
    if monitor_events:
        events = monitor_events | (handshake_events(curve) if curve is not None else 0)
        sock.get_monitor_socket(events, addr=monitor_address())
    elif curve is not None:
        watch_handshakes(sock, bind or connect or "", curve)
    if bind is not None:
        sock.bind(bind)
    elif connect is not None:  # one of the two, checked above
        sock.connect(connect)
    return sock


def send_nowait(
    sock: zmq.Socket[Any], frames: list[bytes], on_error: Callable[[zmq.ZMQError], None]
) -> None:
    """Send without blocking; a failure (a ROUTER's peer gone, a full queue) goes to
    ``on_error``. An asyncio socket reports it in the future it returns, not by raising:
    unobserved, it would only surface as "Future exception was never retrieved"."""
    try:
        sent = sock.send_multipart(frames, flags=zmq.NOBLOCK)
    except zmq.ZMQError as exc:
        on_error(exc)
        return
    if isinstance(sent, asyncio.Future):
        sent.add_done_callback(lambda fut: _report(fut, on_error))


def _report(fut: asyncio.Future[Any], on_error: Callable[[zmq.ZMQError], None]) -> None:
    exc = None if fut.cancelled() else fut.exception()
    if isinstance(exc, zmq.ZMQError):
        on_error(exc)
