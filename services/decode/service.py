"""The decode service: a ROUTER for the router; DEALERs to producers' side channels for
handshakes, heartbeats and fallback releases.

Connect ahead: the first KV handshake with a producer (its NIXL metadata loaded, its
descriptor lists prepared) must not land on a user's request. Every CONNECT_AHEAD_SECONDS
decode asks each configured prefill side channel for its current epoch's handshake and
connects any (engine, epoch) it has not seen: at start, and again after a producer
restarts. A handle from an (engine, epoch) not connected yet (a producer outside the
config, or one that restarted since the last probe) still handshakes lazily, the request
waiting for it; ``pdserve:kv_handshakes{mode}`` counts both kinds.
"""

from __future__ import annotations

import asyncio
from typing import Any

import zmq

from pdserve.common.runtime import protocol as p
from pdserve.common.runtime.engine_commands import (
    Abort,
    Connected,
    Decode,
    HandshakeFailed,
    ProducerKey,
)
from pdserve.common.runtime.service import Service
from pdserve.common.runtime.service_config import DeploymentConfig
from pdserve.common.runtime.sockets import make_socket
from pdserve.services.decode.engine_thread import DecodeContext, DecodeEngineThread

HANDSHAKE_TIMEOUT = 10.0
CONNECT_AHEAD_SECONDS = 2.0
CURRENT: ProducerKey = ("", 0)  # a Handshake for whatever epoch the producer is in now


class DecodeService(Service):
    role = "decode"
    request_types = (p.DecodeRequest,)

    def __init__(self, cfg: DeploymentConfig, instance: int, torch_threads: int) -> None:
        super().__init__(cfg, instance, cfg.decode_addresses[instance].address, p.RouterToDecode)
        self.torch_threads = torch_threads
        self.handlers[p.DecodeRequest] = self.on_decode
        self.handlers[p.Abort] = self.on_abort
        self._side: dict[str, Any] = {}  # side channel address -> DEALER
        self._side_locks: dict[str, asyncio.Lock] = {}
        self._handshakes: dict[ProducerKey, asyncio.Task[None]] = {}
        self._side_decoder: p.Decoder[Any] = p.Decoder(p.FromSideChannel)
        self.decode_engine: DecodeEngineThread  # made at start (make_engine_thread)

    def make_engine_thread(self, loop: asyncio.AbstractEventLoop) -> DecodeEngineThread:
        self.loop = loop
        ctx = DecodeContext(
            **vars(self.engine_context(self.torch_threads)), send_side=self.send_side
        )
        self.decode_engine = DecodeEngineThread(ctx, loop)
        return self.decode_engine

    def background_tasks(self) -> list[asyncio.Task[None]]:
        return [asyncio.create_task(self._heartbeats()), asyncio.create_task(self._connect_ahead())]

    def load(self) -> tuple[int, int]:
        return int(self.metrics.value("pdserve:num_requests_running")), int(
            self.metrics.value("pdserve:num_requests_waiting")
        )

    def unreachable_producers(self) -> list[str]:
        engine = getattr(self, "decode_engine", None)  # made at start
        return [] if engine is None else engine.unreachable_producers  # its thread's snapshot

    # -- router -----------------------------------------------------------------------------

    def on_decode(self, identity: bytes, msg: p.DecodeRequest) -> None:
        handle = msg.handle
        if handle is not None:
            key = (handle.engine_id, handle.epoch)
            if key not in self._handshakes:
                addresses = [r.side_channel for r in handle.replicas]
                self._handshakes[key] = asyncio.create_task(self._handshake(key, addresses))
        self.decode_engine.submit(Decode(identity=identity, request=msg))

    def on_abort(self, identity: bytes, msg: p.Abort) -> None:
        self.decode_engine.submit(Abort(request_id=msg.request_id))

    # -- side channels ----------------------------------------------------------------------

    def side_socket(self, address: str) -> Any:
        sock = self._side.get(address)
        if sock is None:
            sock = self._side[address] = make_socket(
                self.ctx, zmq.DEALER, connect=address, curve=self.security.client
            )
            self._side_locks[address] = asyncio.Lock()
        return sock

    def send_side(self, address: str, msg: p.Message) -> None:
        try:
            self.side_socket(address).send(p.encode(msg), flags=zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            self.log.warning("side_send_failed", peer=address, error=str(exc))

    async def _handshake(
        self, key: ProducerKey, addresses: list[str], first: p.HandshakeReply | None = None
    ) -> None:
        """Fetch every replica's agent metadata once per (engine, epoch): rank r's from
        ``addresses[r]``; ``first``: rank 0's, already fetched (connect ahead)."""
        try:
            replies = [
                first if rank == 0 and first is not None else await self._ask(address, key, rank)
                for rank, address in enumerate(addresses)
            ]
        except Exception as exc:  # timeout, refusal, bad reply: fail the waiting requests
            message = str(exc) or type(exc).__name__
            self.log.warning("handshake_failed", engine_id=key[0], epoch=key[1], error=message)
            self._handshakes.pop(key, None)  # a later request may try again
            self.decode_engine.submit(HandshakeFailed(key=key, message=message))
            return
        self.metrics.inc("pdserve:kv_handshakes", mode="lazy" if first is None else "ahead")
        self.log.info(
            "kv_handshake",
            engine_id=key[0],
            epoch=key[1],
            ahead=first is not None,
            num_ranks=len(replies),
        )
        self.decode_engine.submit(Connected(key=key, replies=replies))

    async def _connect_ahead(self) -> None:
        addresses = (
            []
            if self.cfg.colocated
            else sorted({a.side_channel for a in self.cfg.prefill_addresses if a.side_channel})
        )
        while addresses:
            if self.is_ready:
                await asyncio.gather(*(self._probe(address) for address in addresses))
            await asyncio.sleep(CONNECT_AHEAD_SECONDS)

    async def _probe(self, address: str) -> None:
        """Connect ahead to the producer at ``address`` if its current epoch is new to us,
        or again if a pull found it unreachable (its side channel answering now: a
        partition healed), which clears it from our Pongs once the reconnect works."""
        try:
            first = await self._ask(address, CURRENT, 0)
        except Exception as exc:  # not up yet, or busy: the next probe asks again
            self.log.debug(
                "connect_ahead_pending", peer=address, error=str(exc) or type(exc).__name__
            )
            return
        key = (first.engine_id, first.epoch)
        if key not in self._handshakes or (
            first.engine_id in self.decode_engine.unreachable_producers
            and self._handshakes[key].done()
        ):
            num_ranks = max(1, first.tp_size * first.pcp_size)
            self._handshakes[key] = task = asyncio.create_task(
                self._handshake(key, [address] * num_ranks, first)
            )
            await task

    async def _ask(self, address: str, key: ProducerKey, rank: int) -> p.HandshakeReply:
        sock = self.side_socket(address)
        async with self._side_locks[address]:
            await sock.send(
                p.encode(
                    p.Handshake(
                        engine_id=key[0],
                        epoch=key[1],
                        consumer=f"decode-{self.instance}",
                        rank=rank,
                    )
                )
            )
            deadline = self.loop.time() + HANDSHAKE_TIMEOUT
            while True:
                remaining = deadline - self.loop.time()
                if remaining <= 0 or not await sock.poll(remaining * 1000):
                    raise TimeoutError(
                        f"producer {key[0] or '?'} at {address} did not answer the KV handshake within {HANDSHAKE_TIMEOUT:.0f} s"
                    )
                reply = self._side_decoder.decode(await sock.recv())
                if (
                    isinstance(reply, p.HandshakeReply)
                    and (key == CURRENT or (reply.engine_id, reply.epoch) == key)
                    and reply.agent_name.endswith(f"-r{rank}")
                ):
                    return reply
                if isinstance(reply, p.SideReply) and not reply.ok:
                    raise ConnectionRefusedError(reply.message)
                # a late answer to an earlier, timed-out handshake: skip it

    async def _heartbeats(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.heartbeat_seconds)
            if not self.is_ready:
                continue
            targets = self.decode_engine.pending_by_producer  # the engine thread's snapshot
            for address, (engine_id, epoch, rids, tokens) in targets.items():
                beat = p.Heartbeat(
                    engine_id=engine_id, epoch=epoch, request_ids=rids, tokens=tokens
                )
                self.send_side(address, beat)
