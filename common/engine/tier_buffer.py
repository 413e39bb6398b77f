"""TierBuffer: the bytes of a host tier (common/engine/host_tier.py), a host tensor in the
device cache's layout with ``num_slots`` blocks, and the copies between the two.

On CUDA the buffer is pinned and both copies are ``non_blocking`` on the current stream:
the host enqueues them and goes on, and stream order puts a block's copy down before any
later write to its slot and its copy up before the step that reads it. Writes from outside
the stream (a KV pull into blocks the pool just handed out) wait for ``flush``. On CPU the
"device" cache is host memory too and a copy is a memcpy of one block.
"""

from __future__ import annotations

from typing import Protocol

import msgspec
import torch

from pdserve.common.engine.kv_layout import KVLayout
from pdserve.common.errors import PdserveError


def num_tier_slots(gigabytes: float, layout: KVLayout) -> int:
    """Blocks of ``layout`` in ``gigabytes`` GiB (the tier's size)."""
    num = int(gigabytes * 2**30 // layout.block_bytes)
    if num < 1:
        raise PdserveError(
            f"kv_host_cache_gb = {gigabytes:g} holds no KV block (one is "
            f"{layout.block_bytes / 2**20:.2f} MiB); raise it, or 0 to turn the tier off"
        )
    return num


class CacheOwner(Protocol):
    """A ModelRunner: read ``kv_cache`` at each copy (``resize`` replaces the tensor)."""

    kv_cache: torch.Tensor  # logical [N, L, 2, H_kv, B, D] (common/engine/kv_cache.py)


class TierBuffer:
    def __init__(self, owner: CacheOwner, layout: KVLayout, num_slots: int) -> None:
        self.owner = owner
        self.layout = msgspec.structs.replace(layout, num_blocks=num_slots)
        self._non_blocking = owner.kv_cache.device.type == "cuda"
        self._copied: torch.cuda.Event | None = None  # recorded after the last copy down
        # never read before written: empty, not zeros (no page of it is touched up front)
        storage = torch.empty(
            self.layout.storage_shape,
            dtype=owner.kv_cache.dtype,
            device="cpu",
            pin_memory=self._non_blocking,
        )
        self.slots = storage.permute(self.layout.logical_from_storage)  # [S, L, 2, H_kv, B, D]

    @property
    def block_bytes(self) -> int:
        return self.layout.block_bytes

    def copy_down(self, block: int, slot: int) -> None:
        self.slots[slot].copy_(self.owner.kv_cache[block], non_blocking=self._non_blocking)
        if self._non_blocking:
            self._copied = torch.cuda.Event()
            self._copied.record()

    def flush(self) -> None:
        """Wait for the last copy down (stream order: every earlier one is done too)."""
        if self._copied is not None:
            self._copied.synchronize()
            self._copied = None

    def copy_up(self, slot: int, block: int) -> None:
        self.owner.kv_cache[block].copy_(self.slots[slot], non_blocking=self._non_blocking)
