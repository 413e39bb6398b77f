"""The front ROUTER of a prefill or decode service: each frame decoded with its
direction's typed decoder, checked at the boundary (common/runtime/boundary.py), admitted
(at most ``max_queued_requests`` in flight, none while draining) and dispatched by message
type; replies, pings and metrics queries. Malformed frames are counted, logged and
answered, never fatal. common/runtime/service.py adds the lifecycle and the faults.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
import structlog
import zmq
import zmq.asyncio

from pdserve.common.runtime import boundary
from pdserve.common.runtime import protocol as p
from pdserve.common.runtime.curve import WireSecurity
from pdserve.common.runtime.engine_thread import EngineThread
from pdserve.common.runtime.metrics import Metrics
from pdserve.common.runtime.service_config import DeploymentConfig
from pdserve.common.runtime.sockets import send_nowait

log = structlog.get_logger("pdserve.service")

Handler = Callable[[bytes, Any], Awaitable[None] | None]


class ServiceMessages:
    """What a service does with the messages on its sockets; its state in flight."""

    role = "service"

    request_types: tuple[type, ...] = ()  # the messages that start a request (admission)

    def __init__(self, cfg: DeploymentConfig, instance: int, address: str, inbound: Any) -> None:
        self.cfg = cfg
        self.instance = instance
        self.address = address
        self.metrics = Metrics(self.role, instance)
        self.security = WireSecurity.counted(cfg.security, self.metrics)
        self.ctx = zmq.asyncio.Context()
        self._decoder: p.Decoder[Any] = p.Decoder(inbound)
        self.handlers: dict[type, Handler] = {p.Ping: self.on_ping, p.MetricsQuery: self.on_metrics}
        self.engine_thread: EngineThread | None = None
        self.draining = False
        self.inflight: dict[
            str, tuple[bytes, str]
        ] = {}  # request id -> (router identity, trace id)
        self.front: zmq.asyncio.Socket | None = None
        self.log = log.bind(service=self.role, instance=instance)
        self.routers: dict[bytes, float] = {}  # router identity -> when it last pinged
        self.metrics.declare("pdserve:requests_refused", reason="overloaded")
        self.metrics.declare("pdserve:requests_refused", reason="draining")

    @property
    def is_ready(self) -> bool:
        w = self.engine_thread
        return w is not None and w.ready.is_set() and w.failed is None and not self.draining

    # -- messages -------------------------------------------------------------------------

    async def _receive(
        self, sock: zmq.asyncio.Socket, decoder: p.Decoder[Any], handlers: dict[type, Handler]
    ) -> None:
        while True:
            frames = await sock.recv_multipart()
            if len(frames) != 2:
                self.metrics.inc("pdserve:bad_messages")
                self.log.warning("bad_frame_count", frames=len(frames))
                continue
            identity, payload = frames
            try:
                msg = decoder.decode(payload)
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                self.metrics.inc("pdserve:bad_messages")
                self.log.warning("bad_message", error=str(exc), size=len(payload))
                self.send(
                    sock,
                    identity,
                    p.Failed(
                        request_id="", reason="bad_request", message=f"undecodable message: {exc}"
                    ),
                )
                continue
            if not self._valid(sock, identity, msg):
                continue
            if isinstance(msg, self.request_types) and not self._admit(identity, msg):
                continue
            try:
                result = handlers[type(msg)](identity, msg)
                if result is not None:
                    await result
            except Exception:  # one bad message must not take the service down
                self.log.exception("handler_failed", message_type=type(msg).__name__)

    def _valid(self, sock: zmq.asyncio.Socket, identity: bytes, msg: Any) -> bool:
        """The boundary's semantic checks (common/runtime/boundary.py): a message that
        fails one is answered ``Failed(bad_request)``, counted, and goes no further."""
        engine = self.engine_thread
        problem = boundary.check(msg, engine.limits if engine is not None else None)
        if problem is None:
            return True
        rid = getattr(msg, "request_id", "")
        rid = rid if len(rid) <= boundary.MAX_ID_CHARS else ""
        trace = getattr(msg, "trace_id", "")
        trace = trace if len(trace) <= boundary.MAX_ID_CHARS else ""
        self.metrics.inc("pdserve:bad_messages")
        self.log.warning(
            "bad_message",
            message_type=type(msg).__name__,
            request_id=rid,
            trace_id=trace,
            error=problem,
            peer=identity.hex(),
        )
        refusal = p.Failed(request_id=rid, trace_id=trace, reason="bad_request", message=problem)
        self.send(sock, identity, refusal)
        return False

    def _admit(self, identity: bytes, msg: Any) -> bool:
        if (
            msg.request_id in self.inflight
        ):  # the router never does this; the engine must not see it
            self.metrics.inc("pdserve:bad_messages")
            self.log.warning(
                "duplicate_request_id", request_id=msg.request_id, trace_id=msg.trace_id
            )
            # send, not reply: the request already running under this id keeps its slot
            self.send(
                self.front,
                identity,
                p.Failed(
                    request_id=msg.request_id,
                    trace_id=msg.trace_id,
                    reason="bad_request",
                    message=f"request id {msg.request_id!r} is already in use here",
                ),
            )
            return False
        if self.draining:
            reason = "draining"
            message = f"{self.role} {self.instance} is shutting down (draining); retry the request"
        elif len(self.inflight) >= self.cfg.max_queued_requests:
            reason = "overloaded"
            message = (
                f"{self.role} {self.instance} holds {len(self.inflight)} requests, its limit "
                f"(max_queued_requests); retry later"
            )
        else:
            self.inflight[msg.request_id] = (identity, msg.trace_id)
            return True
        self.metrics.inc("pdserve:requests_refused", reason=reason)
        self.log.warning(
            "request_refused", request_id=msg.request_id, trace_id=msg.trace_id, reason=reason
        )
        self.reply(
            identity,
            p.Failed(
                request_id=msg.request_id, trace_id=msg.trace_id, reason=reason, message=message
            ),
        )
        return False

    def send(self, sock: zmq.asyncio.Socket | None, identity: bytes, msg: p.Message) -> None:
        if sock is None:
            return

        def failed(
            exc: zmq.ZMQError,
        ) -> None:  # the peer is gone (ROUTER_MANDATORY) or its queue is full
            self.log.warning(
                "send_failed", peer=identity.hex(), message_type=type(msg).__name__, error=str(exc)
            )
            if exc.errno == zmq.EHOSTUNREACH:
                self.on_peer_unreachable(identity)

        send_nowait(sock, [identity, p.encode(msg)], failed)

    def on_peer_unreachable(self, identity: bytes) -> None:
        """The connection of peer ``identity`` is gone (common/runtime/service.py aborts its
        requests)."""

    def reply(self, identity: bytes, msg: p.Message) -> None:
        if isinstance(msg, p.PrefillDone | p.Finished | p.Failed):  # the request's end here
            self.inflight.pop(msg.request_id, None)
        self.send(self.front, identity, msg)

    def on_ping(self, identity: bytes, msg: p.Ping) -> None:
        if msg.interval > 0:
            self.routers[identity] = time.monotonic()
        running, waiting = self.load()
        self.reply(
            identity,
            p.Pong(
                sent_at=msg.sent_at,
                service=self.role,
                instance=self.instance,
                ready=self.is_ready,
                num_running=running,
                num_waiting=waiting,
                num_kv_blocks=int(self.metrics.value("pdserve:kv_blocks_total")),
                num_host_blocks=int(self.metrics.value("pdserve:kv_host_cache_blocks_total")),
                unreachable_producers=self.unreachable_producers(),
            ),
        )

    def load(self) -> tuple[int, int]:
        return 0, 0

    def unreachable_producers(self) -> list[str]:
        """Producers (engine ids) this service cannot reach now (a decode's, for Pong)."""
        return []

    def on_metrics(self, identity: bytes, msg: p.MetricsQuery) -> None:
        self.reply(identity, p.MetricsReport(samples=self.metrics.samples()))
