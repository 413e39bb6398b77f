"""GroupTables (pure): the block tables of a request, one per KV cache group, over one pool.

Every group's table has the same length (entry i covers positions ``i * B ..``), so a
step that grows a request by ``k`` entries takes ``k`` blocks per group from the shared
pool. A full group keeps every block; a sliding group returns the ones behind its window
(``drop_outside_window``; their entries become ``NULL_BLOCK``). A block of group ``g`` is
registered in the prefix cache under ``group_hash(hash, g)``, so each group's blocks of a
prefix are found (and evicted) on their own.

With a single group (Llama, Mistral) this is the one table the scheduler always had.
"""

from __future__ import annotations

from collections.abc import Sequence

from pdserve.common.engine.block_pool import BlockHash, BlockPool
from pdserve.common.engine.kv_groups import (
    NULL_BLOCK,
    KVCacheGroup,
    group_hash,
    num_pulled_blocks,
    tables_of_pulled,
)
from pdserve.common.engine.request import Request


class GroupTables:
    def __init__(self, pool: BlockPool, groups: Sequence[KVCacheGroup], block_size: int) -> None:
        if not groups:
            raise ValueError("a cache needs at least one KV cache group")
        self.pool = pool
        self.groups = list(groups)
        self.block_size = block_size

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    def ensure(self, req: Request) -> None:
        """Give a request that holds no blocks one empty table per group."""
        if len(req.tables) != self.num_groups:
            if any(req.tables):
                raise RuntimeError(f"{req.request_id}: tables for another group count")
            req.tables = [[] for _ in self.groups]
            req.dropped = [0] * self.num_groups

    def max_blocks(self, num_tokens: int, chunk: int) -> int:
        """The most blocks of the pool one request of ``num_tokens`` holds at once, over
        every group (a full group: all its blocks; a sliding one: its window's)."""
        return sum(g.max_blocks(num_tokens, self.block_size, chunk) for g in self.groups)

    def blocks_needed(self, req: Request, num: int) -> int:
        """Blocks of the pool to allocate so that ``num`` more tokens fit, all groups."""
        self.ensure(req)
        total = -(-(req.num_computed_tokens + num) // self.block_size)
        return sum(max(0, total - len(t)) for t in req.tables)

    def allocate(self, req: Request, num: int) -> None:
        """Grow every group's table to cover ``num`` more tokens (the caller checked that
        ``blocks_needed`` are free)."""
        self.ensure(req)
        total = -(-(req.num_computed_tokens + num) // self.block_size)
        for table in req.tables:
            if total > len(table):
                table += self.pool.allocate(total - len(table))

    def pulled_blocks_needed(self, num_tokens: int, first_blocks: Sequence[int]) -> int:
        """Blocks a pull of ``num_tokens`` lands in: every group's entries from its first."""
        return num_pulled_blocks(num_tokens, self.block_size, first_blocks)

    def reserve_pulled(self, req: Request, num_tokens: int, first_blocks: Sequence[int]) -> None:
        """Give ``req`` the tables a pull of its prompt lands in (the caller checked that
        ``pulled_blocks_needed`` are free): one run of the pool, split group after group
        in the order a KV handle lists them."""
        blocks = self.pool.allocate(self.pulled_blocks_needed(num_tokens, first_blocks))
        req.tables = tables_of_pulled(blocks, num_tokens, self.block_size, first_blocks)
        req.dropped = list(first_blocks)

    def release(self, req: Request) -> None:
        self.pool.free(req.held_block_ids)
        req.tables = [[] for _ in self.groups]
        req.dropped = [0] * self.num_groups

    def match(self, req: Request, hashes: Sequence[BlockHash]) -> int:
        """Take the longest cached prefix every group can resume from; its length in blocks.

        Resuming at block ``n`` needs every block ``< n`` of a full group, and of a sliding
        group only those the window of position ``n * B`` reaches. ``longest`` is where a
        cache that had kept every sliding block would resume (full groups whole, every
        sliding group's block ``n - 1`` cached); when a sliding group lost a block inside
        that window, the prefix is cut back to where every window is whole, and the
        ``longest - n`` blocks between are replayed (``req.num_replayed_tokens``)."""
        self.ensure(req)
        num, size = len(hashes), self.block_size
        found = [
            [self.pool.cached_block(group_hash(h, g)) for h in hashes]
            for g in range(self.num_groups)
        ]
        full_len = num
        for g, group in enumerate(self.groups):
            if not group.is_sliding:
                full_len = min(
                    full_len, next((i for i, b in enumerate(found[g]) if b is None), num)
                )
        sliding = [g for g, group in enumerate(self.groups) if group.is_sliding]
        longest = next(
            (
                n
                for n in range(full_len, 0, -1)
                if all(found[g][n - 1] is not None for g in sliding)
            ),
            0,
        )
        for n in range(longest, 0, -1):
            firsts = [g.num_blocks_outside(n * size, size) for g in self.groups]
            if all(None not in found[g][firsts[g] : n] for g in range(self.num_groups)):
                for g, first in enumerate(firsts):
                    taken = [b for b in found[g][first:n] if b is not None]
                    self.pool.take(taken)
                    req.tables[g] = [NULL_BLOCK] * first + taken
                    req.dropped[g] = first
                req.num_replayed_tokens = (longest - n) * size
                return n
        req.num_replayed_tokens = longest * size
        return 0

    def drop_outside_window(self, req: Request) -> None:
        """Return the blocks no later query of ``req`` can see, in each sliding group."""
        for g, group in enumerate(self.groups):
            num = group.num_blocks_outside(req.num_computed_tokens, self.block_size)
            if num > req.dropped[g]:
                table = req.tables[g]
                self.pool.free(table[req.dropped[g] : num])
                table[req.dropped[g] : num] = [NULL_BLOCK] * (num - req.dropped[g])
                req.dropped[g] = num

    def register(self, req: Request, num_full: int) -> None:
        """Make the blocks of entries ``req.num_registered_blocks .. num_full`` findable."""
        for g in range(self.num_groups):
            table = req.tables[g]
            for i in range(max(req.num_registered_blocks, req.dropped[g]), num_full):
                self.pool.register(table[i], group_hash(req.block_hashes[i], g))

    def free_tail(self, req: Request) -> None:
        """Free the blocks past the last computed position (they held rejected drafts)."""
        for g in range(self.num_groups):
            table = req.tables[g]
            keep = max(-(-req.num_computed_tokens // self.block_size), req.dropped[g])
            if len(table) > keep:
                self.pool.free(table[keep:])
                del table[keep:]
