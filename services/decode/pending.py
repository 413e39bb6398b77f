"""A decode request waiting for its prompt KV, as its engine thread follows it: handshake
-> local blocks (the engine's scheduler reserves them) -> pull.

``PendingByProducer`` is the snapshot the service's heartbeats name each turn.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from pdserve.common.runtime import protocol as p
from pdserve.common.runtime.engine_commands import ProducerKey

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
