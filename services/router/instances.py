"""The router's links to its prefill and decode instances: connect, receive their replies
into the requests' queues, ping them, scrape their metrics, and tell when one is down.

An instance is down when its connection drops (at once) or when it has answered no ping
for ``peer_timeout_seconds``: its requests in flight fail with ``peer_down`` naming it,
and nothing is routed to it until it answers a ping as ready again. An instance that
answers "not ready" (starting, draining) only stops getting new requests: it still
answers the ones it holds.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import structlog
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from pdserve.common.runtime import protocol as p
from pdserve.common.runtime import supervision
from pdserve.common.runtime.curve import HandshakeLog, WireSecurity
from pdserve.common.runtime.log_throttle import LogThrottle
from pdserve.common.runtime.loop_lag import LoopLag
from pdserve.common.runtime.metrics import Metrics, render
from pdserve.common.runtime.service_config import DeploymentConfig
from pdserve.common.runtime.sockets import make_socket
from pdserve.services.router.links import Link
from pdserve.services.router.request_state import RequestState

# messages of one instance taken at once (Instances._receive): a step's tokens and more
DRAIN_MAX = 1024
log = structlog.get_logger("pdserve.router")

SCRAPE_TIMEOUT = 2.0


class Instances:
    """The instances and the requests they hold (``requests``, by the router's id): the
    part of the router that talks to the services; `Router` adds the requests' lives."""

    def __init__(self, cfg: DeploymentConfig) -> None:
        self.cfg = cfg
        self.metrics = Metrics("router", 0)
        self.security = WireSecurity.counted(cfg.security, self.metrics)
        self.metrics.declare("pdserve:bad_messages")
        self.ping_seconds = cfg.ping_seconds
        self.peer_timeout = cfg.peer_timeout_seconds
        self.ctx = zmq.asyncio.Context()
        self.prefills: list[Link] = []
        self.decodes: list[Link] = []
        self.requests: dict[str, RequestState] = {}
        self._scrapes: dict[str, asyncio.Future[p.MetricsReport]] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self.throttle = LogThrottle()  # a full or lost peer fails every send: few lines
        self._last_tick = time.monotonic()  # the ping loop's last round
        self._stalled_at = -float("inf")  # when this loop last came back from a stall

    async def start(self) -> None:
        if not self.cfg.colocated:
            for i, addrs in enumerate(self.cfg.prefill_addresses):
                self.prefills.append(self._link("prefill", i, addrs.address))
        for i, addrs in enumerate(self.cfg.decode_addresses):
            self.decodes.append(self._link("decode", i, addrs.address))
        self._tasks.append(asyncio.create_task(self._ping_loop()))

    def _link(self, role: str, index: int, address: str) -> Link:
        sock = make_socket(self.ctx, zmq.DEALER, connect=address, curve=self.security.client,
                           monitor_events=zmq.EVENT_DISCONNECTED)  # fmt: skip
        link = Link(role, index, address, sock)
        union = p.PrefillToRouter if role == "prefill" else p.DecodeToRouter
        monitor = sock.get_monitor_socket()  # attached by make_socket
        self._tasks.append(asyncio.create_task(self._receive(link, p.Decoder(union))))
        self._tasks.append(asyncio.create_task(self._watch_connection(link, monitor)))
        self.metrics.declare("pdserve:peer_down", peer=link.name)
        return link

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        self.ctx.destroy(linger=0)

    @property
    def links(self) -> list[Link]:
        return self.prefills + self.decodes

    def stall_mark(self) -> float | None:
        """None, unless this loop is late for its ping round or was stalled less than
        ``peer_timeout_seconds`` ago: then a peer counts as up only once it answered a ping
        after the time returned (inf while the loop is late: no ping went out since).
        Across a stall over ZeroMQ's 5 s heartbeat the connections were dropped, and a
        request sent before the drop is noticed would be lost with them; a peer that
        looks down may be down only in this loop's eyes, and answers within a round."""
        now = time.monotonic()
        if now - self._last_tick > 2 * self.ping_seconds:
            return float("inf")
        return self._stalled_at if now - self._stalled_at < self.peer_timeout else None

    def health_detail(self) -> dict[str, Any]:
        now = time.monotonic()
        detail: dict[str, Any] = {
            link.name: {
                "address": link.address,
                "ready": link.is_alive(now, self.peer_timeout),
                "inflight": len(link.inflight),
                **({"unreachable": sorted(link.unreachable)} if link.unreachable else {}),
            }
            for link in self.links
        }
        # Why a service is down, which only `pdserve up`'s launcher knows (its exit, the
        # port another process holds), and when it is tried again.
        for name, down in supervision.health_detail(self.cfg.supervisor_file).items():
            detail.setdefault(name, {})["supervisor"] = down
        return detail

    async def metrics_text(self) -> bytes:
        self.metrics.set("pdserve:num_requests_running", len(self.requests))  # held here now
        loop = asyncio.get_running_loop()
        waits = []
        for link in self.links:
            if not link.ready:
                continue
            fut: asyncio.Future[p.MetricsReport] = loop.create_future()
            self._scrapes[link.name] = fut
            self._send(link, p.MetricsQuery())
            waits.append(fut)
        samples = self.metrics.samples() + supervision.metric_samples(self.cfg.supervisor_file)
        if waits:
            done, _ = await asyncio.wait(waits, timeout=SCRAPE_TIMEOUT)
            for fut in done:
                samples += fut.result().samples
        return render(samples)

    def _send(self, link: Link, msg: p.Message) -> None:
        try:
            link.sock.send(p.encode(msg), flags=zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            kind = type(msg).__name__
            if (suppressed := self.throttle.allow(("send_failed", link.name, kind))) is not None:
                log.warning("send_failed", peer=link.name, message_type=kind, error=str(exc),
                            suppressed=suppressed)  # fmt: skip

    # -- receiving --------------------------------------------------------------------------

    async def _receive(self, link: Link, decoder: p.Decoder[Any]) -> None:
        # A decode step's tokens arrive together, one message per stream: after one
        # awaited message, those already queued are taken without a future each (the
        # asyncio socket's recv machinery was the router's largest per-token cost). The
        # asyncio socket checks for queued messages itself when next awaited.
        queued: zmq.Socket[bytes] = zmq.Socket.shadow(link.sock.underlying)
        while True:
            payloads = [await link.sock.recv()]
            while len(payloads) < DRAIN_MAX:
                try:
                    payloads.append(queued.recv(zmq.NOBLOCK))
                except zmq.Again:
                    break
            for payload in payloads:
                self._deliver(link, decoder, payload)

    def _deliver(self, link: Link, decoder: p.Decoder[Any], payload: bytes) -> None:
        """One message of an instance: a Pong, a metrics report, or a request's event."""
        try:
            msg = decoder.decode(payload)
        except Exception as exc:
            self.metrics.inc("pdserve:bad_messages")
            if (suppressed := self.throttle.allow(("bad_message", link.name))) is not None:
                log.warning("bad_message", peer=link.name, error=str(exc),
                            suppressed=suppressed)  # fmt: skip
            return
        if isinstance(msg, p.Pong):
            link.ready, link.last_pong, link.lost = msg.ready, time.monotonic(), False
            link.heard = link.last_pong
            link.num_kv_blocks, link.num_host_blocks = msg.num_kv_blocks, msg.num_host_blocks
            self._reachability(link, frozenset(msg.unreachable_producers))
        elif isinstance(msg, p.MetricsReport):
            fut = self._scrapes.pop(link.name, None)
            if fut is not None and not fut.done():
                fut.set_result(msg)
        else:
            state = self.requests.get(msg.request_id)
            if state is not None:
                state.queue.put_nowait(msg)
            elif isinstance(msg, p.PrefillDone | p.TokenChunk):
                # The request already ended here (aborted, or failed while this instance
                # looked down): without an Abort the instance would pin its KV until the
                # lease ran out, or generate for nobody.
                self._send(link, p.Abort(request_id=msg.request_id, trace_id=msg.trace_id))

    async def _ping_loop(self) -> None:
        lag = LoopLag(self.ping_seconds, self.metrics)
        while True:
            now = time.monotonic()
            stalled = lag.tick()
            self._last_tick = now
            if stalled > self.ping_seconds:
                self._stalled_at = now
            for link in self.links:
                if stalled and link.last_pong:  # our stall, not its silence
                    link.last_pong += stalled
                self._send(link, p.Ping(sent_at=time.time(), interval=self.ping_seconds))
                # Silent: down, whether it said ready or not (a draining instance that
                # dies still fails what it held).
                if not link.lost and link.last_pong and now - link.last_pong >= self.peer_timeout:
                    self._peer_down(link, f"answered no ping for {self.peer_timeout:g} s")
                alive = link.is_alive(now, self.peer_timeout)
                if link.up and not alive:  # said "not ready": it still answers what it holds
                    log.warning(
                        "peer_not_ready",
                        peer=link.name,
                        address=link.address,
                        inflight=len(link.inflight),
                    )
                elif alive and not link.up:
                    log.info("peer_up", peer=link.name, address=link.address)
                link.up = alive
            await asyncio.sleep(self.ping_seconds)

    async def _watch_connection(self, link: Link, monitor: zmq.asyncio.Socket) -> None:
        """A dropped connection (the process died, or ZMQ's heartbeat gave up on it) marks
        the instance down at once, not after the ping timeout."""
        handshakes = (
            None
            if self.security.client is None
            else HandshakeLog(link.address, self.security.client)
        )
        while True:
            event = parse_monitor_message(await monitor.recv_multipart())
            if event["event"] == zmq.EVENT_DISCONNECTED and not link.lost:
                self._peer_down(link, "dropped its connection")
            elif handshakes is not None:  # CURVE: a refused handshake is logged
                handshakes(event["event"])

    def _reachability(self, link: Link, unreachable: frozenset[str]) -> None:
        """What a decode's Pong says it cannot pull from now; each change logged once
        (router.py pairs it with the other prefills meanwhile)."""
        if unreachable != link.unreachable:
            log.warning("producers_unreachable", peer=link.name, unreachable=sorted(unreachable),
                        was=sorted(link.unreachable))  # fmt: skip
            link.unreachable = unreachable
            self.metrics.set("pdserve:unreachable_producers", len(unreachable), peer=link.name)

    def _peer_down(self, link: Link, why: str) -> None:
        """Stop routing to ``link`` until it answers a ping as ready again, and fail what it
        holds: the clients learn now. If the instance is still alive, it gets an Abort for
        any of them it answers about later, and aborts them itself once this router's
        pings stop reaching it."""
        link.ready = link.up = False
        link.lost = True
        self.metrics.inc("pdserve:peer_down", peer=link.name)
        log.error(
            "peer_down",
            peer=link.name,
            address=link.address,
            why=why,
            num_failed=len(link.inflight),
        )
        message = f"{link.name} at {link.address} {why}; retry the request"
        for rid in list(link.inflight):
            state = self.requests.get(rid)
            if state is not None:
                state.queue.put_nowait(
                    p.Failed(
                        request_id=rid, trace_id=state.trace_id, reason="peer_down", message=message
                    )
                )
