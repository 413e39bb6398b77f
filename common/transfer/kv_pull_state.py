"""What a ``KVConsumer`` keeps per READ and per connected producer replica, and the
checks a pull's block ids and head slices pass before anything is posted
(common/transfer/kv_consumer.py posts and polls them).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pdserve.common.engine.kv_layout import KVLayout
from pdserve.common.runtime.protocol import HandshakeReply, KVHandle
from pdserve.common.transfer.kv_transfer import _pull_error


@dataclass(eq=False)
class Pull:
    """One posted READ of a request's blocks from one replica."""

    request_id: str
    peer: str  # for messages: agent, engine, epoch
    num_descriptors: int  # coalesced runs
    num_bytes: int
    started_at: float  # time.perf_counter() before building the request
    # On CPU, UCX's CMA GET copies inside transfer(): posting then ~ the whole transfer.
    posted_at: float = 0.0
    done_at: float | None = None
    nixl_descriptors: int | None = None  # NIXL's own count (only with capture_telemetry)
    from_host: bool = False  # a READ of the producer's host-tier slots (DRAM)
    error: str | None = None
    remote: Any = field(default=None, repr=False)  # the Remote read from
    xfer: Any = field(default=None, repr=False)

    @property
    def done(self) -> bool:
        return self.done_at is not None

    @property
    def post_seconds(self) -> float:
        return self.posted_at - self.started_at

    @property
    def transfer_seconds(self) -> float | None:
        return None if self.done_at is None else self.done_at - self.started_at


@dataclass(eq=False)
class Remote:
    reply: HandshakeReply
    dlist: Any  # prepped (head, block)-granular descriptor list of the remote cache
    blocks: Any = None  # block order: prepped list of whole blocks (all heads), else None
    failed: bool = False  # a READ from it failed: releases take the side channel
    # its host tier (NixlHandshake.host_num_slots > 0): the slots' layout (block order) and
    # prepped DRAM lists, (head, block) units and whole blocks, as of the cache above
    host_layout: KVLayout | None = None
    host_dlist: Any = None
    host_blocks: Any = None
    num_posted: int = 0  # READs from it posted and not ended (a failed one is reconnected at 0)


def check_ids(
    layout: KVLayout,
    request_id: str,
    peer: str,
    handle: KVHandle,
    remote: Remote,
    local: np.ndarray,
    remote_ids: np.ndarray,
    num_remote: int | None = None,
) -> None:
    """Refused before posting: NIXL would reject the indices, but say which ones and why.
    ``layout``: the local cache's; ``num_remote``: the remote's blocks (its host tier's
    slots for a READ from the tier; None: its cache's)."""
    if handle.layout != remote.reply.layout:
        why = f"handle layout {handle.layout} differs from the handshake's"
        raise _pull_error(request_id, peer, f"refused, {why}")
    if len(handle.block_ids) != len(local):
        why = f"{len(handle.block_ids)} remote blocks but {len(local)} local"
        raise _pull_error(request_id, peer, f"refused, {why}")
    for side, ids, n in (
        (
            "remote",
            remote_ids,
            remote.reply.layout.num_blocks if num_remote is None else num_remote,
        ),
        ("local", local, layout.num_blocks),
    ):
        if len(ids) and (ids.min() < 0 or ids.max() >= n):  # C-speed check; list only on error
            bad = [int(b) for b in ids if not 0 <= b < n][:8]
            why = f"{side} block ids {bad} outside [0, {n})"
            raise _pull_error(request_id, peer, f"refused, {why}")


def check_heads(
    layout: KVLayout,
    request_id: str,
    peer: str,
    remote: Remote,
    heads: list[tuple[int, int, int]],
) -> None:
    """Every (remote first head, local first head, count) slice inside both caches."""
    for src, dst, n in heads:
        if (
            n < 0
            or src < 0
            or dst < 0
            or src + n > remote.reply.layout.num_kv_heads
            or dst + n > layout.num_kv_heads
        ):
            why = (
                f"head slice (remote {src}, local {dst}, count {n}) outside remote "
                f"{remote.reply.layout.num_kv_heads} / local {layout.num_kv_heads} KV heads"
            )
            raise _pull_error(request_id, peer, f"refused, {why}")
