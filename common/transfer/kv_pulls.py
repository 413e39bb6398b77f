"""Pulls, whatever backend moves them: the READ specs a decode rank posts and ``Puller``, the
consumer role of a transfer backend (common/transfer/backend.py) and what the decode engine
thread needs of whatever runs its pulls. A backend's puller (NIXL's: ``NixlPuller`` in
common/transfer/nixl_backend.py) runs in the decode engine's thread (TP 1) and in each
decode rank process (TP > 1), where the engine thread drives the ranks through
``services/decode/pullers.RankPuller``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import msgspec

from pdserve.common.runtime import protocol as p


class PullSpec(msgspec.Struct, array_like=True, frozen=True):
    """One READ a decode rank posts: blocks of one producer replica, some of its heads."""

    replica: int  # index into the handle's replicas
    remote_block_ids: list[int]
    local_block_ids: list[int]
    heads: list[tuple[int, int, int]]  # (remote first head, local first head, count)
    # KVHandle.host_slots of these blocks (empty: all on the device): where >= 0, the
    # block is read from that slot of the producer's host tier
    remote_host_slots: list[int] = []

    def parts(self) -> list[tuple[bool, list[int], list[int]]]:
        """(from the host tier, remote ids, local ids) of each non-empty part: the device
        blocks (VRAM descriptors on a GPU), then the tier slots (DRAM ones); a backend
        posts one READ each."""
        if not self.remote_host_slots:
            return [(False, self.remote_block_ids, self.local_block_ids)]
        rows = list(zip(self.remote_block_ids, self.remote_host_slots, self.local_block_ids,
                        strict=True))  # fmt: skip
        device = [(b, lo) for b, s, lo in rows if s < 0]
        host = [(s, lo) for _, s, lo in rows if s >= 0]
        return [
            (from_host, [r for r, _ in pairs], [lo for _, lo in pairs])
            for from_host, pairs in ((False, device), (True, host))
            if pairs
        ]


# What a consumer's pull error says when the producer did not answer on the transport (a
# READ ended in error, none could be posted, or the reconnect after one is pending or
# failed: common/transfer/kv_consumer.py), as against a refusal (stale epoch, bad ids).
UNREACHABLE_ERRORS = (
    "transfer failed: NIXL state",
    "posting the READ failed",
    "unreachable since a READ from it failed",
    "reconnecting failed",
)


def is_unreachable(error: str) -> bool:
    """Whether a pull's error says its producer is unreachable from this decode (the
    router then avoids pairing them: the decode names it in its Pongs)."""
    return any(marker in error for marker in UNREACHABLE_ERRORS)


@dataclass
class PullResult:
    request_id: str
    error: str | None  # None: every READ of the request finished
    num_bytes: int = 0
    num_descriptors: int = 0
    seconds: float = 0.0
    # of those, the READs of the producer's host-tier slots: their bytes and the longest
    # one's seconds (the tier pull's GB/s; 0 where the puller does not split them, TP > 1)
    host_bytes: int = 0
    host_seconds: float = 0.0


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

    @property
    def busy(self) -> bool:
        """READs in flight (a rank process then polls sooner)."""

    def close(self) -> None: ...
