"""TierBuffer: the bytes of a host tier (common/engine/host_tier.py), a host tensor of
``num_slots`` blocks in the device cache's layout (block order), and the copies between
the two.

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

from pdserve.common.engine.kv_cache import storage_of
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
    """A ModelRunner: read at each copy (``resize`` replaces the tensor and its layout)."""

    kv_cache: torch.Tensor  # logical [N, L, 2, H_kv, B, D] (common/engine/kv_cache.py)
    layout: KVLayout


class TierBuffer:
    def __init__(self, owner: CacheOwner, layout: KVLayout, num_slots: int) -> None:
        self.owner = owner
        # Block order whatever the cache's: a slot is one contiguous run of bytes, so a
        # copy between the two is one memcpy on the host's side (a head-order device block
        # is gathered on the device first, by torch)
        self.layout = msgspec.structs.replace(layout, num_blocks=num_slots, order="block")
        self._non_blocking = owner.kv_cache.device.type == "cuda"
        self._copied: torch.cuda.Event | None = None  # recorded after the last copy down
        # never read before written: empty, not zeros (no page of it is touched up front)
        self.slots = torch.empty(
            self.layout.storage_shape,  # [S, H_kv, L, 2, B, D]
            dtype=owner.kv_cache.dtype,
            device="cpu",
            pin_memory=self._non_blocking,
        )

    @property
    def block_bytes(self) -> int:
        return self.layout.block_bytes

    @property
    def logical(self) -> torch.Tensor:
        """The slots as a cache's logical view, [S, L, 2, H_kv, B, D] (a producer serves
        them as it serves its cache)."""
        return self.slots.permute(self.layout.logical_from_storage)

    def _device_block(self, block: int) -> torch.Tensor:
        """Device ``block`` in the slots' shape: [H_kv, L, 2, B, D]."""
        storage = storage_of(self.owner.kv_cache, self.owner.layout)
        return storage[block] if self.owner.layout.order == "block" else storage[:, block]

    def copy_down(self, block: int, slot: int) -> None:
        self.slots[slot].copy_(self._device_block(block), non_blocking=self._non_blocking)
        if self._non_blocking:
            self._copied = torch.cuda.Event()
            self._copied.record()

    def flush(self) -> None:
        """Wait for the last copy down (stream order: every earlier one is done too)."""
        if self._copied is not None:
            self._copied.synchronize()
            self._copied = None

    def copy_up(self, slot: int, block: int) -> None:
        self._device_block(block).copy_(self.slots[slot], non_blocking=self._non_blocking)
