"""The router's connection to one prefill or decode instance."""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from pdserve.common.engine.block_pool import BlockHash

PREFIX_MEMORY = 50_000  # block hashes remembered per prefill instance (affinity hints)
# What a block likely held only in an instance's host tier counts for, against 1 for one
# likely on its device: a tier hit saves the prefill too, less its copy back up.
HOST_TIER_WEIGHT = 0.5


@dataclass
class Link:
    role: str  # "prefill" | "decode"
    index: int
    address: str
    sock: Any
    ready: bool = False  # as its last Pong said; False from the moment it is found down
    last_pong: float = 0.0  # moved forward past the router's own stalls (loop_lag.py)
    heard: float = 0.0  # when its last Pong really came (time.monotonic())
    up: bool = False  # alive at the last ping round (each change is logged once)
    lost: bool = False  # found down (silent or disconnected), not heard from since
    outstanding_tokens: int = 0
    # decode: prompt tokens it prefills itself (local_prefill.py) and has not answered yet
    local_queued_tokens: int = 0
    inflight: set[str] = field(default_factory=set)
    # remembered block hashes, least recent first, each with the count of blocks
    # remembered before its last use (how far down the instance's LRU it has sunk since)
    prefixes: OrderedDict[BlockHash, int] = field(default_factory=OrderedDict)
    num_remembered: int = 0
    # its pools as its Pongs say (0: not known); with a host tier, how long ago a block was
    # remembered says whether it is likely on the device, in the tier, or gone
    num_kv_blocks: int = 0
    num_host_blocks: int = 0
    # a decode's: the prefills (their names, "prefill-N") its pulls cannot reach now
    unreachable: frozenset[str] = frozenset()

    @property
    def name(self) -> str:
        return f"{self.role}-{self.index}"

    def is_alive(self, now: float, timeout: float) -> bool:
        return self.ready and now - self.last_pong < timeout

    def cached_prefix(self, hashes: list[BlockHash]) -> int:
        """Leading blocks of a prompt this instance has most likely cached."""
        num = 0
        for h in hashes:
            if h not in self.prefixes:
                break
            num += 1
        return num

    def prefix_score(self, hashes: list[BlockHash]) -> float:
        """The leading blocks of a prompt this instance most likely has cached, each block
        likely only in its host tier counted ``HOST_TIER_WEIGHT``. Without a tier every
        remembered block counts 1 (``cached_prefix``)."""
        if not self.num_host_blocks:
            return float(self.cached_prefix(hashes))
        device = self.num_kv_blocks or PREFIX_MEMORY
        score = 0.0
        for h in hashes:
            stamp = self.prefixes.get(h)
            if stamp is None:
                break
            age = self.num_remembered - 1 - stamp  # blocks remembered after it
            if age < device:
                score += 1.0
            elif age < device + self.num_host_blocks:
                score += HOST_TIER_WEIGHT
            else:
                break  # evicted from both, most likely
        return score

    def remember(self, hashes: list[BlockHash]) -> None:
        for h in hashes:
            self.prefixes[h] = self.num_remembered
            self.prefixes.move_to_end(h)
            self.num_remembered += 1
        while len(self.prefixes) > PREFIX_MEMORY:
            self.prefixes.popitem(last=False)


def pick(
    links: list[Link], hashes: list[BlockHash] | None = None, timeout: float = 5.0
) -> Link | None:
    """The live link with the longest cached prefix (host-tier blocks counting less,
    ``Link.prefix_score``), then the fewest outstanding tokens."""
    now = time.monotonic()
    alive = [link for link in links if link.is_alive(now, timeout)]
    if not alive:
        return None
    if hashes:
        return max(alive, key=lambda link: (link.prefix_score(hashes), -link.outstanding_tokens))
    return min(alive, key=lambda link: link.outstanding_tokens)


def reachable_prefills(
    prefills: list[Link], decodes: list[Link], now: float, timeout: float
) -> list[Link]:
    """The prefills some live decode can pull from (none names it unreachable in its
    Pongs). When no live one is left so (every decode cut from every live prefill), all of
    them: the request goes as before, its pull failed or recomputed as
    ``kv_load_failure_policy`` says."""
    live = [d for d in decodes if d.is_alive(now, timeout)]
    reached = [
        link
        for link in prefills
        if link.is_alive(now, timeout) and any(link.name not in d.unreachable for d in live)
    ]
    return reached or prefills


def decodes_reaching(producer: str, decodes: list[Link], now: float, timeout: float) -> list[Link]:
    """The decodes that can pull from prefill ``producer`` (its engine id, the link's
    name); all of them when no live one can (as ``reachable_prefills``)."""
    reaching = [d for d in decodes if d.is_alive(now, timeout) and producer not in d.unreachable]
    return reaching or decodes
