"""The NIXL transfer backend (common/transfer/backend.py): its producer is ``KVProducer``
(common/transfer/kv_transfer.py), its consumer ``NixlPuller``, READs posted on a
``KVConsumer`` (common/transfer/kv_consumer.py). NIXL itself is imported only when an agent
starts."""

from __future__ import annotations

from typing import TYPE_CHECKING

import msgspec

from pdserve.common.errors import PdserveError
from pdserve.common.runtime import protocol as p
from pdserve.common.transfer.backend import CacheSpec, ProducerSpec
from pdserve.common.transfer.kv_pulls import PullResult, PullSpec
from pdserve.common.transfer.kv_transfer import NIXL as NAME
from pdserve.common.transfer.kv_transfer import KVProducer

if TYPE_CHECKING:
    from pdserve.common.transfer.kv_consumer import KVConsumer
    from pdserve.common.transfer.kv_pull_state import Pull


class NixlPuller:
    """NIXL's consumer role: one KVConsumer in this thread (the decode engine's at TP 1, a
    decode rank's); a request reported once all its READs ended."""

    def __init__(self, spec: CacheSpec) -> None:
        from pdserve.common.transfer.kv_consumer import KVConsumer

        self.consumer = KVConsumer(
            agent_name=spec.agent_name,
            kv_cache=spec.kv_cache,
            layout=spec.layout,
            compat=spec.compat,
        )
        self._pulls: dict[str, list[Pull]] = {}
        self._results: list[PullResult] = []

    def connect(self, replies: list[p.HandshakeReply]) -> None:
        for reply in replies:
            self.consumer.connect(reply)

    def start(self, rid: str, handle: p.KVHandle, plan: list[list[PullSpec]]) -> None:
        try:
            self._pulls[rid] = start_pulls(self.consumer, rid, handle, plan[0])
        except PdserveError as exc:
            self._results.append(PullResult(rid, str(exc)))

    def poll(self) -> list[PullResult]:
        self.consumer.progress()
        out, self._results = self._results, []
        for rid, pulls in list(self._pulls.items()):
            try:
                if not all([self.consumer.poll(pull) for pull in pulls if not pull.done]):
                    continue
            except PdserveError as exc:
                for pull in pulls:
                    self.consumer.abort(pull)
                del self._pulls[rid]
                out.append(PullResult(rid, str(exc)))
                continue
            del self._pulls[rid]
            out.append(PullResult(rid, None, *pull_stats(pulls)))
        return out

    @property
    def busy(self) -> bool:
        return bool(self._pulls)

    def release(self, handle: p.KVHandle, rid: str, trace_id: str) -> list[int]:
        return self.consumer.release(handle, rid, trace_id)

    def close(self) -> None:
        self.consumer.close()


def start_pulls(
    consumer: KVConsumer, rid: str, handle: p.KVHandle, specs: list[PullSpec]
) -> list[Pull]:
    """Post one READ per spec and place (device blocks, host-tier slots: one memory kind
    a READ); on a failure the ones already posted are aborted."""
    pulls: list[Pull] = []
    try:
        for spec in specs:
            for from_host, remote_ids, local_ids in spec.parts():
                sub = msgspec.structs.replace(handle, block_ids=remote_ids)
                pulls.append(
                    consumer.start_pull(
                        rid,
                        sub,
                        local_ids,
                        spec.replica,
                        heads=[(src, dst, n) for src, dst, n in spec.heads],
                        from_host=from_host,
                    )
                )
    except Exception:
        for pull in pulls:
            consumer.abort(pull)
        raise
    return pulls


def pull_stats(pulls: list[Pull]) -> tuple[int, int, float, int, float]:
    """(bytes, descriptors, seconds, host-tier bytes, host-tier seconds) of a request's
    finished pulls on one rank: seconds the longest READ's, of all and of the tier's."""
    seconds = max((pull.transfer_seconds or 0.0 for pull in pulls), default=0.0)
    host = [pull for pull in pulls if pull.from_host]
    return (
        sum(pull.num_bytes for pull in pulls),
        sum(pull.num_descriptors for pull in pulls),
        seconds,
        sum(pull.num_bytes for pull in host),
        max((pull.transfer_seconds or 0.0 for pull in host), default=0.0),
    )


class NixlBackend:
    name = NAME

    def producer(self, spec: ProducerSpec) -> KVProducer:
        return KVProducer(
            engine_id=spec.engine_id,
            epoch=spec.epoch,
            agent_name=spec.agent_name,
            kv_cache=spec.kv_cache,
            layout=spec.layout,
            compat=spec.compat,
            tp_rank=spec.tp_rank,
            tp_size=spec.tp_size,
            pcp_rank=spec.pcp_rank,
            pcp_size=spec.pcp_size,
            host_cache=spec.host_cache,
            host_layout=spec.host_layout,
        )

    def consumer(self, spec: CacheSpec) -> NixlPuller:
        return NixlPuller(spec)


NIXL = NixlBackend()
