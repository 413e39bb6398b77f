"""The prefill service: a ROUTER for the router, a side channel for decode instances."""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

import zmq

from pdserve.common.runtime import protocol as p
from pdserve.common.runtime.engine_commands import Abort, Heartbeat, Prefill, SideRelease
from pdserve.common.runtime.service import Service
from pdserve.common.runtime.service_config import DeploymentConfig
from pdserve.common.runtime.service_messages import Handler
from pdserve.common.runtime.sockets import make_socket
from pdserve.services.prefill.engine_thread import PrefillContext, PrefillEngineThread


class PrefillService(Service):
    role = "prefill"
    request_types = (p.PrefillRequest,)

    def __init__(self, cfg: DeploymentConfig, instance: int, torch_threads: int) -> None:
        addrs = cfg.prefill_addresses[instance]
        super().__init__(cfg, instance, addrs.address, p.RouterToPrefill)
        self.side_channel = addrs.side_channel  # advertised in every handle
        self.side_bind = addrs.bound(addrs.side_channel)
        self.torch_threads = torch_threads
        self.engine_id = f"prefill-{instance}"
        # A new epoch on every start: handles issued by an earlier life are refused.
        self.epoch = time.time_ns()
        # One per rank, published by the engine thread once its agents exist.
        self.handshake_replies: list[p.HandshakeReply] = []
        self.prefill_engine: PrefillEngineThread | None = None
        self.side: Any = None
        self.handlers[p.PrefillRequest] = self.on_prefill
        self.handlers[p.Abort] = self.on_abort
        self.side_handlers: dict[type, Handler] = {
            p.Handshake: self.on_handshake,
            p.Heartbeat: self.on_heartbeat,
            p.Release: self.on_release,
        }
        self.log = self.log.bind(engine_id=self.engine_id, pid=os.getpid())

    def make_engine_thread(self, loop: asyncio.AbstractEventLoop) -> PrefillEngineThread:
        base = self.engine_context(self.torch_threads)
        ctx = PrefillContext(
            **vars(base),
            engine_id=self.engine_id,
            epoch=self.epoch,
            side_channel=self.side_channel,
            publish_handshakes=self._set_handshake_replies,
        )
        self.prefill_engine = PrefillEngineThread(ctx, loop)
        return self.prefill_engine

    def _set_handshake_replies(self, replies: list[p.HandshakeReply]) -> None:
        self.handshake_replies = replies

    async def start_sockets(self) -> None:
        self.side = make_socket(
            self.ctx, zmq.ROUTER, bind=self.side_bind, curve=self.security.server
        )

    def background_tasks(self) -> list[asyncio.Task[None]]:
        side_decoder: p.Decoder[Any] = p.Decoder(p.ToSideChannel)
        return [asyncio.create_task(self._receive(self.side, side_decoder, self.side_handlers))]

    def num_busy(self) -> int:
        # Pinned KV counts too: a decode may still be pulling it.
        engine = self.prefill_engine
        return len(self.inflight) + (engine.num_leases if engine is not None else 0)

    def load(self) -> tuple[int, int]:
        return int(self.metrics.value("pdserve:num_requests_running")), int(
            self.metrics.value("pdserve:num_requests_waiting")
        )

    # -- router -----------------------------------------------------------------------------

    def on_prefill(self, identity: bytes, msg: p.PrefillRequest) -> None:
        assert self.engine_thread is not None
        self.engine_thread.submit(Prefill(identity=identity, request=msg))

    def on_abort(self, identity: bytes, msg: p.Abort) -> None:
        assert self.engine_thread is not None
        self.inflight.pop(msg.request_id, None)  # an aborted prefill sends no reply
        self.engine_thread.submit(Abort(request_id=msg.request_id))

    # -- side channel -----------------------------------------------------------------------

    def on_handshake(self, identity: bytes, msg: p.Handshake) -> None:
        replies = self.handshake_replies
        if not replies:
            answer: p.Message = p.SideReply(ok=False, message=f"{self.engine_id} is still starting")
        elif not 0 <= msg.rank < len(replies):
            answer = p.SideReply(
                ok=False, message=f"{self.engine_id} has no rank {msg.rank} (pcp = {len(replies)})"
            )
        elif (msg.engine_id, msg.epoch) not in (
            (self.engine_id, self.epoch),
            ("", 0),
        ):  # ("", 0): connect ahead
            answer = p.SideReply(
                ok=False,
                message=(
                    f"stale KV handle: it names {msg.engine_id} epoch {msg.epoch}, but this producer "
                    f"is {self.engine_id} epoch {self.epoch} (it restarted); resubmit the request"
                ),
            )
        else:
            answer = replies[msg.rank]
            # connect-ahead probes come every few seconds from every decode: not worth info
            (self.log.debug if msg.epoch == 0 else self.log.info)(
                "handshake", consumer=msg.consumer, rank=msg.rank
            )
        self.send(self.side, identity, answer)

    def on_heartbeat(self, identity: bytes, msg: p.Heartbeat) -> None:
        assert self.engine_thread is not None
        self.engine_thread.submit(Heartbeat(beat=msg))

    def on_release(self, identity: bytes, msg: p.Release) -> None:
        assert self.engine_thread is not None
        self.engine_thread.submit(SideRelease(release=msg))
