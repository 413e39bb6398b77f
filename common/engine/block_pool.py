"""BlockPool: the KV block allocator of one engine (pure: knows nothing of tensors).

Blocks carry reference counts so a cached prefix can be shared by several requests.
A full block whose tokens are known gets a chained hash (``hash(parent, tokens)``) and
stays findable after it is freed, until its slot is needed again (LRU eviction). Free
blocks without a hash are handed out lowest id first, so a request's blocks tend to be
contiguous runs -- what makes KV transfers few, large descriptors.

With asynchronous scheduling a step may still run on the device when the host frees
blocks it reads or writes; while ``fence`` is set, frees are held under it and take
effect in ``unfence`` (common/engine/async_steps.py).

With a host tier (``tier``, common/engine/host_tier.py) a cached block the pool evicts is
copied down first, and ``hold_prefix`` brings tier hits back up into device blocks.
"""

from __future__ import annotations

import hashlib
import heapq
from collections import OrderedDict
from collections.abc import Callable, Sequence

import msgspec

from pdserve.common.engine.host_tier import HostTier

BlockHash = bytes

_encoder = msgspec.msgpack.Encoder()


def hash_block(parent: BlockHash | None, token_ids: Sequence[int]) -> BlockHash:
    """Stable across processes (unlike ``hash()``), so routers can compare prefixes."""
    payload = _encoder.encode((parent or b"", list(token_ids)))
    return hashlib.blake2b(payload, digest_size=16).digest()


def hash_blocks(
    token_ids: Sequence[int], block_size: int, parent: BlockHash | None = None
) -> list[BlockHash]:
    """Chained hashes of every full block of ``token_ids``, continuing from ``parent``."""
    hashes: list[BlockHash] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block(parent, token_ids[start : start + block_size])
        hashes.append(parent)
    return hashes


class NoFreeBlocks(Exception):
    """Raised by ``allocate`` when the pool cannot satisfy a request right now."""


class BlockPool:
    def __init__(self, num_blocks: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"a block pool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self._ref_counts = [0] * num_blocks
        self._free_plain: list[int] = list(range(num_blocks))  # min-heap of unhashed free ids
        self._free_cached: OrderedDict[int, None] = OrderedDict()  # hashed free ids, LRU first
        # a block's hashes: one, or (a compressed group's block, common/engine/kv_groups.py)
        # one per token block whose closed entries it ends
        self._hash_of: dict[int, list[BlockHash]] = {}
        self._block_of: dict[BlockHash, int] = {}
        # The serial of the newest step that may still run on the device (None: none);
        # frees made meanwhile wait in ``_fenced`` under it.
        self.fence: int | None = None
        self._fenced: list[tuple[int, list[int]]] = []
        # Waits until no step runs on the device (set by the engine that fences; None:
        # the device runs each step to its end before the host goes on, as the CPU does)
        self.wait_idle: Callable[[], None] | None = None
        # The host tier under the prefix cache (None: an evicted block is forgotten)
        self.tier: HostTier | None = None

    @property
    def num_fenced(self) -> int:
        """Block references freed while a step may still use them (upper bound of the
        blocks ``unfence`` returns)."""
        return sum(len(blocks) for _, blocks in self._fenced)

    def unfence(self, upto: int | None = None) -> None:
        """Apply the frees held for steps up to serial ``upto`` (all: None), now known done."""
        keep = []
        for serial, blocks in self._fenced:
            if upto is None or serial <= upto:
                self._free_now(blocks)
            else:
                keep.append((serial, blocks))
        self._fenced = keep

    def settle(self) -> None:
        """Wait for the device and apply every held free (the scheduler is short of blocks
        that fenced frees would give)."""
        if self._fenced:
            if self.wait_idle is not None:
                self.wait_idle()
            self.unfence()

    @property
    def num_free_blocks(self) -> int:
        return len(self._free_plain) + len(self._free_cached)

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def allocate(self, num: int) -> list[int]:
        if num > self.num_free_blocks:
            raise NoFreeBlocks(f"need {num} blocks, {self.num_free_blocks} free")
        blocks = []
        evicted: list[tuple[int, list[BlockHash]]] = []
        for _ in range(num):
            if self._free_plain:
                block = heapq.heappop(self._free_plain)
            else:
                block, _ = self._free_cached.popitem(last=False)
                if self.tier is not None:
                    evicted.append((block, list(self._hash_of[block])))
                self._forget(block)
            self._ref_counts[block] = 1
            blocks.append(block)
        # Down into the tier in the reverse of eviction order: a sequence is evicted tail
        # first (``free``), so its blocks take the tier's slots in sequence order, and a
        # consumer reading them from the tier gets adjacent slots as one descriptor
        # (common/transfer/kv_descs.py num_runs) instead of one per block.
        if self.tier is not None:
            for block, hashes in reversed(evicted):
                self.tier.offload(block, hashes)
        return blocks

    def free(self, blocks: Sequence[int]) -> None:
        """Drop one reference from each block; the last reference returns it to the pool.
        Freed in reverse so the tail of a sequence is evicted before its shared prefix."""
        if self.fence is not None:
            self._fenced.append((self.fence, list(blocks)))
            return
        self._free_now(blocks)

    def _free_now(self, blocks: Sequence[int]) -> None:
        for block in reversed(blocks):
            count = self._ref_counts[block]
            if count <= 0:
                raise RuntimeError(f"block {block} freed twice")
            self._ref_counts[block] = count - 1
            if count == 1:
                if block in self._hash_of:
                    self._free_cached[block] = None
                else:
                    heapq.heappush(self._free_plain, block)

    def match_prefix(self, hashes: Sequence[BlockHash]) -> list[int]:
        """The cached blocks of the longest run of leading ``hashes``, each now referenced
        once more (the caller owns them as if allocated)."""
        found = []
        for h in hashes:
            block = self.cached_block(h)
            if block is None:
                break
            found.append(block)
        self.take(found)
        return found

    def hold_prefix(self, hashes: Sequence[BlockHash]) -> list[int]:
        """Reference the blocks of the longest run of leading ``hashes`` cached on the
        device or in the tier, tier hits copied up into blocks of the pool (registered
        under their hashes: device hits from now on). The references only keep the run
        from evicting itself while it is brought up: the caller takes its own
        (``match_prefix``, ``GroupTables.match``), then ``drop``s these."""
        held: list[int] = []
        if not self.enable_prefix_caching:
            return held
        for h in hashes:
            block = self._block_of.get(h)
            if block is not None:
                self.take([block])
            else:
                slot = None if self.tier is None else self.tier.slot_of(h)
                if slot is None or not self.num_free_blocks:
                    break
                assert self.tier is not None
                self.tier.touch(slot)  # most recently used: the copy-down below spares it
                (block,) = self.allocate(1)  # may copy another block down first
                if self.tier.slot_of(h) != slot:  # a one-slot tier recycled it after all
                    self._free_now([block])
                    break
                self.tier.reload(slot, block)
                for slot_hash in self.tier.hashes_of(slot):
                    self.register(block, slot_hash)
            held.append(block)
        return held

    def drop(self, blocks: Sequence[int]) -> None:
        """Free references no step ever saw (``hold_prefix``'s): at once, fence or not."""
        self._free_now(blocks)

    def hashes_of(self, block: int) -> list[BlockHash]:
        """The hashes ``block`` is registered under (none: not a full, hashed block)."""
        return list(self._hash_of.get(block, ()))

    def cached_block(self, block_hash: BlockHash) -> int | None:
        """The block holding ``block_hash``, if the prefix cache still has it."""
        if not self.enable_prefix_caching:
            return None
        return self._block_of.get(block_hash)

    def take(self, blocks: Sequence[int]) -> None:
        """Reference cached blocks (from ``cached_block``) once more, as if allocated."""
        for block in blocks:
            if self._ref_counts[block] == 0:
                del self._free_cached[block]
            self._ref_counts[block] += 1

    def evict(self, block_hash: BlockHash) -> bool:
        """Forget a free cached block's hash (its slot becomes a plain free block); False
        when it is not cached or still in use. The pool's own eviction is allocate's (least
        recently freed first); this one is for tests that lose one chosen block of a prefix
        (tests/test_kv_groups.py, tests/test_sliding_window.py)."""
        block = self._block_of.get(block_hash)
        if block is None or self._ref_counts[block]:
            return False
        del self._free_cached[block]
        self._forget(block)
        heapq.heappush(self._free_plain, block)
        return True

    def _forget(self, block: int) -> None:
        for block_hash in self._hash_of.pop(block):
            del self._block_of[block_hash]

    def count_cached_prefix(self, hashes: Sequence[BlockHash]) -> int:
        """How many leading blocks are cached, without taking them."""
        if not self.enable_prefix_caching:
            return 0
        num = 0
        for h in hashes:
            if h not in self._block_of:
                break
            num += 1
        return num

    def register(self, block_id: int, block_hash: BlockHash) -> None:
        """Make a full, computed block findable by its hash (first writer wins); a block may
        be registered under several hashes (what each names must never change after)."""
        if not self.enable_prefix_caching or block_hash in self._block_of:
            return
        self._hash_of.setdefault(block_id, []).append(block_hash)
        self._block_of[block_hash] = block_id

    def reset_prefix_cache(self) -> None:
        if self.tier is not None:
            self.tier.clear()
        for block in list(self._free_cached):
            self._forget(block)
            heapq.heappush(self._free_plain, block)
        self._free_cached.clear()
