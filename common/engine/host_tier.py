"""HostTier (pure): the index of a host-memory tier under a BlockPool's prefix cache.

The device pool forgets a cached block when it needs the slot (``BlockPool.allocate``);
with a tier, that block's K/V is first copied down into a slot of host memory of the same
block layout, and a later prompt whose prefix misses the device pool but hits the tier
gets the block copied back up into a device block before the step that reads it
(``BlockPool.hold_prefix``). The tier is inclusive: a block brought back up keeps its
slot, so evicting it again copies nothing.

This class knows slots and hashes only; the bytes are moved by a ``TierMover``
(common/engine/tier_buffer.py: a host tensor in the cache's layout). Slots are recycled
least recently used first; each hash lives in at most one slot (a block is never held
twice). No running request references a slot (it reads its device copy); a slot is kept
from recycling only while ``pin``ned: a consumer may READ it straight from host memory
(a prefill lease publishing a tier block, issue #39), until the matching ``unpin``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Protocol

BlockHash = bytes


class TierMover(Protocol):
    """Moves one block's K/V between the device cache and a tier slot."""

    def copy_down(self, block: int, slot: int) -> None: ...

    def copy_up(self, slot: int, block: int) -> None: ...

    def flush(self) -> None:
        """Wait until every copy down asked for so far has read its block."""

    @property
    def block_bytes(self) -> int: ...


class HostTier:
    def __init__(self, num_slots: int, mover: TierMover | None = None) -> None:
        if num_slots < 1:
            raise ValueError(f"a host tier needs at least one slot, got {num_slots}")
        self.num_slots = num_slots
        self.mover = mover  # None: indexes only (the pure tests)
        self._free: list[int] = list(range(num_slots - 1, -1, -1))  # pop() gives slot 0 first
        self._used: OrderedDict[int, list[BlockHash]] = OrderedDict()  # slot -> hashes, LRU first
        self._slot_of: dict[BlockHash, int] = {}
        self._pins: dict[int, int] = {}  # slot -> pins held (never recycled while any)
        self._stale: set[int] = set()  # pinned slots ``clear`` forgot: free at their last unpin
        # totals in blocks since start (metrics read them as counters)
        self.num_hits = 0  # blocks a prefix lookup found here and brought up
        self.num_offloaded = 0  # blocks copied down
        self.num_reloaded = 0  # blocks copied up
        self.num_served = 0  # pins: blocks a consumer was handed to read from here

    @property
    def num_blocks(self) -> int:
        """Slots holding a block now."""
        return len(self._used)

    @property
    def block_bytes(self) -> int:
        return self.mover.block_bytes if self.mover is not None else 0

    def slot_of(self, block_hash: BlockHash) -> int | None:
        return self._slot_of.get(block_hash)

    def hashes_of(self, slot: int) -> list[BlockHash]:
        return list(self._used[slot])

    def __contains__(self, block_hash: BlockHash) -> bool:
        return block_hash in self._slot_of

    def offload(self, block: int, hashes: Sequence[BlockHash]) -> int | None:
        """Keep device ``block`` (about to be forgotten under ``hashes``) in a slot: the
        least recently used unpinned one when none is free. None when the tier has it
        already (then it only counts as used now) or every slot is pinned."""
        held = {self._slot_of[h] for h in hashes if h in self._slot_of}
        if held:
            for used in held:
                self._used.move_to_end(used)
            return None
        slot = self._free.pop() if self._free else self._recycle()
        if slot is None:  # every slot pinned: the block is forgotten, as without a tier
            return None
        self._used[slot] = list(hashes)
        for h in hashes:
            self._slot_of[h] = slot
        if self.mover is not None:
            self.mover.copy_down(block, slot)
        self.num_offloaded += 1
        return slot

    def touch(self, slot: int) -> None:
        """Count ``slot`` as used now (recycled last)."""
        self._used.move_to_end(slot)

    def reload(self, slot: int, block: int) -> None:
        """Copy ``slot`` up into device ``block`` (a prefix hit in the tier)."""
        self._used.move_to_end(slot)
        if self.mover is not None:
            self.mover.copy_up(slot, block)
        self.num_hits += 1
        self.num_reloaded += 1

    def _recycle(self) -> int | None:
        """The least recently used slot no pin holds, its hashes forgotten; None when
        every used slot is pinned."""
        slot = next((s for s in self._used if s not in self._pins), None)
        if slot is None:
            return None
        for h in self._used.pop(slot):
            del self._slot_of[h]
        return slot

    @property
    def num_pinned(self) -> int:
        """Slots some pin holds now."""
        return len(self._pins)

    def pin(self, block_hash: BlockHash) -> int | None:
        """Keep the slot holding ``block_hash`` from being recycled (and so rewritten)
        until ``unpin``: a reader outside this process may READ it meanwhile. Pins count:
        a slot returns to the LRU order at its last unpin. None when the tier does not
        hold the hash."""
        slot = self._slot_of.get(block_hash)
        if slot is None:
            return None
        self._pins[slot] = self._pins.get(slot, 0) + 1
        self._used.move_to_end(slot)
        self.num_served += 1
        return slot

    def unpin(self, slot: int) -> None:
        """Drop one pin of ``slot`` (``pin``'s result); RuntimeError when it holds none,
        as a block freed twice is."""
        count = self._pins.get(slot, 0)
        if count <= 0:
            raise RuntimeError(f"host tier slot {slot} unpinned more often than pinned")
        if count > 1:
            self._pins[slot] = count - 1
            return
        del self._pins[slot]
        if slot in self._stale:
            self._stale.discard(slot)
            self._free.append(slot)

    def flush(self) -> None:
        """Before something outside the device's stream writes blocks the pool just handed
        out (a KV pull's RDMA): their old contents must have reached the tier first."""
        if self.mover is not None:
            self.mover.flush()

    def clear(self) -> None:
        """Forget every block (the prefix cache was reset, or the engine drains). A pinned
        slot keeps its bytes for its reader and becomes free at its last unpin."""
        self._used.clear()
        self._slot_of.clear()
        self._stale = set(self._pins)
        self._free = [s for s in range(self.num_slots - 1, -1, -1) if s not in self._pins]
