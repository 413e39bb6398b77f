"""Pulls of one consumer agent: the READ specs a decode rank posts; ``Puller``, what the
decode engine thread needs of whatever runs them; and ``LocalPuller``, which posts them on a
KVConsumer and reports each request once, when all its READs ended. LocalPuller runs in the
decode engine's thread (TP 1) and in each decode rank process (TP > 1), where the engine
thread drives the ranks through ``services/decode/pullers.RankPuller``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import msgspec

from pdserve.common.errors import PdserveError
from pdserve.common.runtime import protocol as p

if TYPE_CHECKING:
    from pdserve.common.engine.model_runner import ModelRunner
    from pdserve.common.transfer.kv_consumer import KVConsumer
    from pdserve.common.transfer.kv_pull_state import Pull


class PullSpec(msgspec.Struct, array_like=True, frozen=True):
    """One READ a decode rank posts: blocks of one producer replica, some of its heads."""

    replica: int  # index into the handle's replicas
    remote_block_ids: list[int]
    local_block_ids: list[int]
    heads: list[tuple[int, int, int]]  # (remote first head, local first head, count)


@dataclass
class PullResult:
    request_id: str
    error: str | None  # None: every READ of the request finished
    num_bytes: int = 0
    num_descriptors: int = 0
    seconds: float = 0.0


class Puller(Protocol):
    """Pulls of whole requests: every ``start`` is answered by exactly one ``PullResult``
    from ``poll``, once no READ of the request is in flight any more."""

    def connect(self, replies: list[p.HandshakeReply]) -> None:
        """Connect to every replica rank of a producer life (raises KVTransferError)."""

    def start(self, rid: str, handle: p.KVHandle, plan: list[list[PullSpec]]) -> None:
        """Post ``plan`` (the READs of each decode rank, services/decode/pullers.py)."""

    def poll(self) -> list[PullResult]: ...

    def release(self, handle: p.KVHandle, rid: str, trace_id: str) -> list[int]:
        """Release every replica rank; returns the indices no notification reached."""

    def close(self) -> None: ...


class LocalPuller:
    """One KVConsumer in this thread: the decode engine's at TP 1, a decode rank's."""

    def __init__(self, agent_name: str, runner: ModelRunner) -> None:
        from pdserve.common.transfer.kv_consumer import KVConsumer

        self.consumer = KVConsumer(
            agent_name=agent_name,
            kv_cache=runner.kv_cache,
            layout=runner.layout,
            compat=runner.kv_compat(),
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
    """Post one READ per spec; on a failure the ones already posted are aborted."""
    pulls: list[Pull] = []
    try:
        for spec in specs:
            sub = msgspec.structs.replace(handle, block_ids=spec.remote_block_ids)
            pulls.append(
                consumer.start_pull(
                    rid,
                    sub,
                    spec.local_block_ids,
                    spec.replica,
                    heads=[(src, dst, n) for src, dst, n in spec.heads],
                )
            )
    except Exception:
        for pull in pulls:
            consumer.abort(pull)
        raise
    return pulls


def pull_stats(pulls: list[Pull]) -> tuple[int, int, float]:
    """(bytes, descriptors, seconds) of a request's finished pulls on one rank."""
    seconds = max((pull.transfer_seconds or 0.0 for pull in pulls), default=0.0)
    return (
        sum(pull.num_bytes for pull in pulls),
        sum(pull.num_descriptors for pull in pulls),
        seconds,
    )
