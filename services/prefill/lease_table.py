"""LeaseTable (pure): which prefilled requests still pin KV blocks, and until when.

A request's blocks are freed exactly once: when every producer rank holding a replica
has reported the request released, or when its lease runs out. A rank never hides its
completion: each one is tracked on its own, so one rank's lost release expires that
rank's hold only (counted per rank) while the others are recorded as released on time.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Lease:
    request_id: str
    trace_id: str
    block_ids: list[int]
    deadline: float
    pending_ranks: set[int]
    released_ranks: set[int] = field(default_factory=set)
    token: str = ""  # the handle's secret: releases and heartbeats must name it


@dataclass(frozen=True)
class Freed:
    """A lease that ended: its blocks go back to the pool."""

    request_id: str
    trace_id: str
    block_ids: list[int]
    expired_ranks: tuple[int, ...]  # ranks that never reported a release (lease expiry)


class LeaseTable:
    def __init__(self, num_ranks: int, lease_seconds: float) -> None:
        self.num_ranks = num_ranks
        self.lease_seconds = lease_seconds
        self._leases: dict[str, Lease] = {}

    def __len__(self) -> int:
        return len(self._leases)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._leases

    def add(
        self, request_id: str, trace_id: str, block_ids: list[int], now: float, token: str = ""
    ) -> float:
        """Pin ``block_ids``; returns the lease deadline. ``token``: the handle's secret."""
        deadline = now + self.lease_seconds
        self._leases[request_id] = Lease(
            request_id, trace_id, block_ids, deadline, set(range(self.num_ranks)), token=token
        )
        return deadline

    def owns(self, request_id: str, token: str) -> bool:
        """Whether ``token`` is the secret of ``request_id``'s lease (unknown: True, a no-op)."""
        lease = self._leases.get(request_id)
        return lease is None or lease.token == token

    def extend(
        self, request_ids: list[str], now: float, tokens: list[str] | None = None
    ) -> list[str]:
        """Push the deadlines of still-held requests whose token matches; returns those
        unknown here or named with a wrong token."""
        unknown = []
        for i, rid in enumerate(request_ids):
            lease = self._leases.get(rid)
            token = tokens[i] if tokens is not None and i < len(tokens) else ""
            if lease is None or lease.token != token:
                unknown.append(rid)
            else:
                lease.deadline = max(lease.deadline, now + self.lease_seconds)
        return unknown

    def release(self, request_id: str, rank: int, token: str | None = None) -> Freed | None:
        """Rank ``rank`` is done with ``request_id``; the blocks when it was the last.
        ``token`` (None: the producer's own abort) must be the lease's secret."""
        lease = self._leases.get(request_id)
        if lease is None or rank not in lease.pending_ranks:
            return None  # late (after expiry) or repeated: nothing held any more
        if token is not None and token != lease.token:
            return None  # not from whoever received the handle: refused (the caller counts)
        lease.pending_ranks.discard(rank)
        lease.released_ranks.add(rank)
        if lease.pending_ranks:
            return None
        del self._leases[request_id]
        return Freed(request_id, lease.trace_id, lease.block_ids, ())

    def expire(self, now: float) -> list[Freed]:
        freed = []
        for rid in [r for r, lease in self._leases.items() if lease.deadline <= now]:
            lease = self._leases.pop(rid)
            freed.append(
                Freed(rid, lease.trace_id, lease.block_ids, tuple(sorted(lease.pending_ranks)))
            )
        return freed

    def drop_all(self) -> list[Freed]:
        """Everything still held (shutdown): the ranks that never released count as expired."""
        return self.expire(float("inf"))
