"""The router's connection to one prefill or decode instance."""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from pdserve.common.engine.block_pool import BlockHash

PREFIX_MEMORY = 50_000  # block hashes remembered per prefill instance (affinity hints)


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
    inflight: set[str] = field(default_factory=set)
    prefixes: OrderedDict[BlockHash, None] = field(default_factory=OrderedDict)

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

    def remember(self, hashes: list[BlockHash]) -> None:
        for h in hashes:
            self.prefixes[h] = None
            self.prefixes.move_to_end(h)
        while len(self.prefixes) > PREFIX_MEMORY:
            self.prefixes.popitem(last=False)


def pick(
    links: list[Link], hashes: list[BlockHash] | None = None, timeout: float = 5.0
) -> Link | None:
    """The live link with the longest cached prefix, then the fewest outstanding tokens."""
    now = time.monotonic()
    alive = [link for link in links if link.is_alive(now, timeout)]
    if not alive:
        return None
    if hashes:
        return max(alive, key=lambda link: (link.cached_prefix(hashes), -link.outstanding_tokens))
    return min(alive, key=lambda link: link.outstanding_tokens)
