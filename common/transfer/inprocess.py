"""The in-process transfer backend: producer and consumer caches in one process (tests of
the scheduler and the transfer lifecycle without NIXL). A pull is a real copy of the
blocks' bytes from the producer's cache tensor into the consumer's; a release goes into
the producer's inbox. Producers are found by replica name in this process's table.

Faults for tests: ``InProcessConsumer.hold`` keeps the named requests' pulls in flight
until cleared (a pull that outlives its producer's lease), ``fail`` ends them with an error.
"""

from __future__ import annotations

import queue
import threading
import time

import msgspec
import numpy as np

from pdserve.common.errors import PdserveError
from pdserve.common.runtime.protocol import HandshakeReply, KVHandle, Release
from pdserve.common.transfer.backend import CacheSpec, ProducerSpec, backend_mismatch, release_of
from pdserve.common.transfer.kv_pull_state import Remote, check_heads, check_ids
from pdserve.common.transfer.kv_pulls import PullResult, PullSpec
from pdserve.common.transfer.kv_transfer import KVTransferError, incompatibilities, peer_name

NAME = "inprocess"

# replica name -> producer: every live producer of this process (engine threads share it)
_producers: dict[str, InProcessProducer] = {}
_lock = threading.Lock()


class InProcessProducer:
    def __init__(self, spec: ProducerSpec) -> None:
        self.spec = spec
        self._reply = spec.reply(NAME, b"")
        self._inbox: queue.SimpleQueue[Release] = queue.SimpleQueue()  # from any thread
        with _lock:
            if spec.agent_name in _producers:
                raise KVTransferError(f"producer {spec.agent_name!r} exists in this process")
            _producers[spec.agent_name] = self

    @property
    def handshake_reply(self) -> HandshakeReply:
        return self._reply

    def deliver(self, release: Release) -> None:
        """A consumer's release (any thread)."""
        self._inbox.put(release)

    def poll_releases(self) -> list[Release]:
        out: list[Release] = []
        while True:
            try:
                release = self._inbox.get_nowait()
            except queue.Empty:
                return out
            if (release.engine_id, release.epoch) == (self.spec.engine_id, self.spec.epoch):
                out.append(release)

    def close(self) -> None:
        with _lock:
            if _producers.get(self.spec.agent_name) is self:
                del _producers[self.spec.agent_name]


class InProcessConsumer:
    """A Puller (common/transfer/kv_pulls.py) of one cache; reports a pull at the next poll."""

    def __init__(self, spec: CacheSpec) -> None:
        self.spec = spec
        self._remotes: dict[tuple[str, int, str], Remote] = {}
        self._done: dict[str, PullResult] = {}  # copied (or failed), reported at next poll
        self.hold: set[str] = set()  # request ids whose pulls stay in flight (tests)
        self.fail: dict[str, str] = {}  # request id -> error its pull ends with (tests)
        self.num_host_blocks_read = 0  # blocks read from producers' host tiers (tests)

    def connect(self, replies: list[HandshakeReply]) -> None:
        for reply in replies:
            peer = peer_name(reply.engine_id, reply.epoch, reply.agent_name)
            mismatch = backend_mismatch(reply, NAME)
            diffs = [mismatch] if mismatch else []
            diffs += incompatibilities(self.spec.layout, self.spec.compat, reply)
            if diffs:
                raise KVTransferError(f"KV handshake with {peer} refused: " + "; ".join(diffs))
            self._remotes[(reply.engine_id, reply.epoch, reply.agent_name)] = Remote(reply, None)

    def start(self, rid: str, handle: KVHandle, plan: list[list[PullSpec]]) -> None:
        started = time.perf_counter()
        num_bytes = 0
        try:
            for spec in plan[0]:
                num_bytes += self._copy(rid, handle, spec)
        except PdserveError as exc:
            self._done[rid] = PullResult(rid, str(exc))
            return
        seconds = time.perf_counter() - started
        self._done[rid] = PullResult(rid, None, num_bytes, len(plan[0]), seconds)

    def _copy(self, rid: str, handle: KVHandle, spec: PullSpec) -> int:
        agent = handle.replicas[spec.replica].agent_name
        peer = peer_name(handle.engine_id, handle.epoch, agent)
        remote = self._remotes.get((handle.engine_id, handle.epoch, agent))
        with _lock:
            producer = _producers.get(agent)
        if remote is None or producer is None:
            raise KVTransferError(f"KV pull of request {rid!r} from {peer}: not connected")
        check_heads(self.spec.layout, rid, peer, remote, spec.heads)
        num_bytes = 0
        for from_host, remote_block_ids, local_block_ids in spec.parts():
            # the tier's slots are a cache of their own: [S, L, 2, H_kv, B, D]
            src = producer.spec.host_cache if from_host else producer.spec.kv_cache
            host_layout = producer.spec.host_layout
            if src is None or (from_host and host_layout is None):
                raise KVTransferError(
                    f"KV pull of request {rid!r} from {peer}: refused, it serves no host tier"
                )
            local = np.array(local_block_ids, dtype=np.int64)
            remote_ids = np.array(remote_block_ids, dtype=np.int64)
            sub = msgspec.structs.replace(handle, block_ids=remote_block_ids)
            num_remote = host_layout.num_blocks if from_host and host_layout else None
            check_ids(self.spec.layout, rid, peer, sub, remote, local, remote_ids, num_remote)
            dst = self.spec.kv_cache  # [N, L, 2, H_kv, B, D]
            for s, d, n in spec.heads:
                rows = src[remote_ids.tolist(), :, :, s : s + n]  # a copy: [n, L, 2, h, B, D]
                dst[local.tolist(), :, :, d : d + n] = rows.to(dst.device)
                num_bytes += rows.numel() * rows.element_size()
            if from_host:
                self.num_host_blocks_read += len(remote_block_ids)
        return num_bytes

    def poll(self) -> list[PullResult]:
        out = []
        for rid in [r for r in self._done if r not in self.hold]:
            result = self._done.pop(rid)
            why = self.fail.pop(rid, None)
            out.append(PullResult(rid, why) if why is not None else result)
        return out

    @property
    def busy(self) -> bool:
        return bool(self._done)

    def release(self, handle: KVHandle, rid: str, trace_id: str) -> list[int]:
        unreached = []
        for index, replica in enumerate(handle.replicas):
            with _lock:
                producer = _producers.get(replica.agent_name)
            if producer is None:
                unreached.append(index)
                continue
            producer.deliver(release_of(handle, rid, trace_id, index))
        return unreached

    def close(self) -> None:
        self._remotes.clear()


class InProcessBackend:
    name = NAME

    def producer(self, spec: ProducerSpec) -> InProcessProducer:
        return InProcessProducer(spec)

    def consumer(self, spec: CacheSpec) -> InProcessConsumer:
        return InProcessConsumer(spec)


IN_PROCESS = InProcessBackend()
