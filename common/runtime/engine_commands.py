"""Every command a service's asyncio loop hands its engine thread: one Struct per kind,
a tagged union per role. In-process only (a thread-safe queue, never the wire); the engine
thread dispatches on the type through its handler table (``EngineThread.handlers``)."""

from __future__ import annotations

import threading

import msgspec

from pdserve.common.runtime import protocol as p

ProducerKey = tuple[str, int]  # (engine_id, epoch) of a prefill instance's life


class Command(msgspec.Struct, tag=True, kw_only=True):
    pass


# -- every role --------------------------------------------------------------------------


class Abort(Command):
    request_id: str


class Barrier(Command):
    """Set ``done`` once every command submitted before this one has been handled."""

    done: threading.Event


# -- prefill -----------------------------------------------------------------------------


class Prefill(Command):
    identity: bytes  # the router's, to reply to
    request: p.PrefillRequest


class Heartbeat(Command):
    beat: p.Heartbeat


class SideRelease(Command):
    """A release that came over the side channel (its NIXL notification could not)."""

    release: p.Release


# -- decode ------------------------------------------------------------------------------


class Decode(Command):
    identity: bytes  # the router's, to reply to
    request: p.DecodeRequest


class Connected(Command):
    """Every replica rank of a producer life answered the handshake."""

    key: ProducerKey
    replies: list[p.HandshakeReply]


class HandshakeFailed(Command):
    key: ProducerKey
    message: str


PrefillCommand = Prefill | Abort | Heartbeat | SideRelease | Barrier
DecodeCommand = Decode | Connected | HandshakeFailed | Abort | Barrier
