"""A decode request waiting for its prompt KV, as its engine thread follows it: handshake
-> local blocks (the engine's scheduler reserves them) -> pull -> release, in
``PendingPulls``, the thread's table of them.

``PendingByProducer`` is the snapshot the service's heartbeats name each turn.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import structlog

from pdserve.common.errors import FatalError, PdserveError
from pdserve.common.runtime import protocol as p
from pdserve.common.runtime.engine_commands import ProducerKey
from pdserve.common.transfer.kv_pulls import is_unreachable

if TYPE_CHECKING:
    from pdserve.common.runtime.fault_hooks import FaultHooks
    from pdserve.common.runtime.metrics import Metrics
    from pdserve.common.transfer.kv_pulls import Puller, PullResult
    from pdserve.services.decode.decode_engine import DecodeEngine

log = structlog.get_logger("pdserve.decode")

# Heartbeat targets: producer side channel -> (engine_id, epoch, request ids still waiting,
# their handles' tokens)
PendingByProducer = dict[str, tuple[str, int, list[str], list[str]]]


@dataclass
class PendingPull:
    identity: bytes
    msg: p.DecodeRequest
    handle: p.KVHandle
    arrived: float = field(default_factory=time.monotonic)
    pulling: bool = False  # READs posted, not all ended
    aborted: bool = False
    marks: dict[str, float] = field(
        default_factory=lambda: {"decode_received": time.time()}
    )  # common/runtime/ttft.py

    @property
    def key(self) -> ProducerKey:
        return self.handle.engine_id, self.handle.epoch


def pending_by_producer(pending: dict[str, PendingPull]) -> PendingByProducer:
    """Requests accepted but not yet pulled, by producer side channel (heartbeats)."""
    out: PendingByProducer = {}
    for rid, pp in pending.items():
        for replica in pp.handle.replicas:
            entry = out.setdefault(
                replica.side_channel, (pp.handle.engine_id, pp.handle.epoch, [], [])
            )
            if rid not in entry[2]:  # several replicas share one side channel
                entry[2].append(rid)
                entry[3].append(pp.handle.token)
    return out


class PendingPulls:
    """A decode engine thread's requests waiting for their prompt KV, and the producers
    they wait on: each request's handshake, local blocks (the engine's scheduler reserves
    them), READs, and the release of every producer replica, exactly once whether the pull
    worked, failed or was aborted. A pull that ended is handed to ``ended`` (its request
    id, its entry, None or why it failed) at once, after its replicas' release, so what a
    failure frees serves the next request in the same turn."""

    def __init__(self, engine: DecodeEngine, puller: Puller, *, tp: int, striped: bool,
                 metrics: Metrics, faults: FaultHooks,
                 send_release: Callable[[str, p.Release], None],
                 ended: Callable[[str, PendingPull, str | None], None]) -> None:  # fmt: skip
        """``send_release``: a Release to a producer's side channel (one NIXL could not
        deliver); ``striped``: READs striped over the PCP replicas."""
        self.engine = engine
        self.puller = puller
        self.tp = tp
        self.striped = striped
        self.metrics = metrics
        self.faults = faults
        self.send_release = send_release
        self.ended = ended
        self.requests: dict[str, PendingPull] = {}
        self.producers: dict[ProducerKey, str | None] = {}  # None: connected; str: why not
        self.connected_at: dict[ProducerKey, float] = {}  # wall time of each producer's handshake
        # engine ids the last pull from failed on the transport (kv_pulls.is_unreachable),
        # until a pull from it works or its (re)connect does: the router avoids the pair
        self.unreachable: set[str] = set()

    def __len__(self) -> int:
        return len(self.requests)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.requests

    def get(self, request_id: str) -> PendingPull | None:
        return self.requests.get(request_id)

    def add(self, request_id: str, pp: PendingPull) -> None:
        self.requests[request_id] = pp

    def pop(self, request_id: str) -> PendingPull | None:
        """Forget a request (not released: the caller releases it or its lease expires)."""
        return self.requests.pop(request_id, None)

    @property
    def is_pulling(self) -> bool:
        return any(pp.pulling for pp in self.requests.values())

    def by_producer(self) -> PendingByProducer:
        return pending_by_producer(self.requests) if self.requests else {}

    def connect(self, key: ProducerKey, replies: list[p.HandshakeReply]) -> None:
        try:
            self.puller.connect(replies)
            self.producers[key] = None
            self.connected_at[key] = time.time()
            if key[0] in self.unreachable:
                self.unreachable.discard(key[0])
                log.info("kv_producer_reachable", engine_id=key[0], epoch=key[1])
        except PdserveError as exc:
            if key[0] in self.unreachable and self.producers.get(key, "") is None:
                # a reconnect after a partition (connect ahead): still unreachable, not refused
                log.warning("kv_reconnect_failed", engine_id=key[0], epoch=key[1], error=str(exc))
                return
            self.producers[key] = str(exc)
            log.error("kv_handshake_refused", engine_id=key[0], epoch=key[1], error=str(exc))

    def handshake_failed(self, key: ProducerKey, message: str) -> None:
        for rid, pp in list(self.requests.items()):
            if pp.key == key and not pp.pulling:
                self._failed(rid, pp, message, release=False)

    def advance(self) -> None:
        # Start first, then poll: a pull posted now is seen done in this same iteration
        # (on CPU, UCX copies inside the post) instead of one engine step later.
        for rid, pp in list(self.requests.items()):
            if not pp.pulling:
                try:
                    self._maybe_start(rid, pp)
                except FatalError:
                    raise
                except Exception as exc:  # a handle the boundary let through: this request only
                    log.exception("pull_start_failed", request_id=rid)
                    self._failed(rid, pp, f"{type(exc).__name__}: {exc}", release=False)
        for result in self.puller.poll():
            polled = self.requests.get(result.request_id)
            if polled is not None:
                self._pulled(result.request_id, polled, result)

    def _maybe_start(self, rid: str, pp: PendingPull) -> None:
        from pdserve.services.decode.pullers import plan_pulls

        state = self.producers.get(pp.key, "pending")
        if state == "pending":
            return
        if state is not None:
            self._failed(rid, pp, state, release=True)
            return
        if self.faults.pulls_held():
            return
        try:
            blocks = self.engine.reserve_remote(rid)
        except PdserveError as exc:
            self._failed(rid, pp, str(exc), release=True)
            return
        if blocks is None:
            return  # wait for decodes to finish; heartbeats keep the producer's lease
        try:
            plan = plan_pulls(
                pp.handle,
                blocks,
                self.engine.model_config.num_key_value_heads,
                self.tp,
                self.striped,
            )
        except PdserveError as exc:
            self._failed(rid, pp, str(exc), release=True)
            return
        pp.pulling = True
        pp.marks["handshake_done"] = max(
            pp.marks["decode_received"], self.connected_at.get(pp.key, 0.0)
        )
        pp.marks["pull_started"] = time.time()
        self.puller.start(rid, pp.handle, plan)

    def _pulled(self, rid: str, pp: PendingPull, result: PullResult) -> None:
        pp.pulling = False
        if result.error is not None:
            if is_unreachable(result.error) and pp.key[0] not in self.unreachable:
                self.unreachable.add(pp.key[0])
                log.warning("kv_producer_unreachable", engine_id=pp.key[0], epoch=pp.key[1],
                            request_id=rid, trace_id=pp.msg.trace_id)  # fmt: skip
            self._failed(rid, pp, result.error, release=True)
            return
        self.unreachable.discard(pp.key[0])
        del self.requests[rid]
        pp.marks["pull_done"] = time.time()
        self.metrics.inc("pdserve:kv_transfers")
        self.metrics.inc("pdserve:kv_transfer_bytes", result.num_bytes)
        self.metrics.inc("pdserve:kv_transfer_descriptors", result.num_descriptors)
        self.metrics.observe("pdserve:kv_transfer_seconds", result.seconds)
        if result.host_bytes:  # read from the producer's host tier: its GB/s, bench serve's
            self.metrics.inc("pdserve:kv_host_tier_pull_bytes", result.host_bytes)
            self.metrics.inc("pdserve:kv_host_tier_pull_seconds", result.host_seconds)
        self.release(pp.handle, rid, pp.msg.trace_id)
        log.debug(
            "kv_pulled",
            request_id=rid,
            trace_id=pp.msg.trace_id,
            bytes=result.num_bytes,
            descriptors=result.num_descriptors,
            seconds=round(result.seconds, 4),
        )
        self.ended(rid, pp, None)

    def _failed(self, rid: str, pp: PendingPull, message: str, release: bool) -> None:
        self.requests.pop(rid, None)
        self.metrics.inc("pdserve:kv_transfer_failures")
        log.warning(
            "kv_pull_failed",
            request_id=rid,
            trace_id=pp.msg.trace_id,
            engine_id=pp.handle.engine_id,
            error=message,
        )
        if release:
            self.release(pp.handle, rid, pp.msg.trace_id)
        self.ended(rid, pp, message)

    def release(self, handle: p.KVHandle, rid: str, trace_id: str) -> None:
        """Tell every replica rank that this request's KV is no longer needed."""
        if self.producers.get((handle.engine_id, handle.epoch)) is not None:
            unreached = list(range(len(handle.replicas)))  # never connected: no NIXL path
        else:
            unreached = self.puller.release(handle, rid, trace_id)
        for index in unreached:
            self.metrics.inc("pdserve:kv_notification_failures")
            release = p.Release(
                request_id=rid,
                trace_id=trace_id,
                engine_id=handle.engine_id,
                epoch=handle.epoch,
                rank=index,
                token=handle.token,
            )
            self.send_release(handle.replicas[index].side_channel, release)
