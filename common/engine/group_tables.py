"""GroupTables (pure): the block tables of a request, one per KV cache group, over one pool.

Every group's table has the same length (entry i covers positions ``i * B ..``), so a
step that grows a request by ``k`` entries takes ``k`` blocks per group from the shared
pool. A full group keeps every block; a sliding group returns the ones behind its window
(``drop_outside_window``; their entries become ``NULL_BLOCK``). A block of group ``g`` is
registered in the prefix cache under ``group_hash(hash, g)``, so each group's blocks of a
prefix are found (and evicted) on their own.

A compressed group (``rate`` m > 1, DeepSeek-V4's entries) has a table ``1 / m`` as long
and keeps every block. Its block of the entries closed by token block i is registered under
``group_hash(hash_i, g)`` for every i (a block of B entries is found under each token block
whose entries it ends; slots once written never change). A prefix hit takes the full blocks
and the open last one; the open one is copied before the request writes its next entries
into it (``Request.block_copies``, done by the runner first thing in the step).

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
        # no sliding group: no block ever leaves a window (drop_outside_window, each step)
        self._any_sliding = any(g.is_sliding for g in self.groups)

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
            req.open_shared = []

    def max_blocks(self, num_tokens: int, chunk: int) -> int:
        """The most blocks of the pool one request of ``num_tokens`` holds at once, over
        every group (a full group: all its blocks; a sliding one: its window's)."""
        return sum(g.max_blocks(num_tokens, self.block_size, chunk) for g in self.groups)

    def blocks_needed(self, req: Request, num: int) -> int:
        """Blocks of the pool to allocate so that ``num`` more tokens fit, all groups."""
        self.ensure(req)
        end = req.num_computed_tokens + num
        grow = len(req.open_shared)
        for g, t in zip(self.groups, req.tables, strict=True):  # a loop: each decode, each step
            more = g.num_entries(end, self.block_size) - len(t)
            if more > 0:
                grow += more
        return grow

    def allocate(self, req: Request, num: int) -> None:
        """Grow every group's table to cover ``num`` more tokens (the caller checked that
        ``blocks_needed`` are free)."""
        self.ensure(req)
        end = req.num_computed_tokens + num
        for group, table in zip(self.groups, req.tables, strict=True):
            total = group.num_entries(end, self.block_size)
            if total > len(table):
                table += self.pool.allocate(total - len(table))
        for g, i in req.open_shared:  # copy on write: the open block of a prefix hit
            src, (dst,) = req.tables[g][i], self.pool.allocate(1)
            req.block_copies.append((src, dst))
            req.tables[g][i] = dst
            # freed now, copied first thing in the step: no write of this step or a later
            # one comes before the copy
            self.pool.free([src])
        req.open_shared = []

    @property
    def rates(self) -> list[int]:
        return [g.rate for g in self.groups]

    def pulled_blocks_needed(self, num_tokens: int, first_blocks: Sequence[int]) -> int:
        """Blocks a pull of ``num_tokens`` lands in: every group's entries from its first."""
        return num_pulled_blocks(num_tokens, self.block_size, first_blocks, self.rates)

    def reserve_pulled(self, req: Request, num_tokens: int, first_blocks: Sequence[int]) -> None:
        """Give ``req`` the tables a pull of its prompt lands in (the caller checked that
        ``pulled_blocks_needed`` are free): one run of the pool, split group after group
        in the order a KV handle lists them."""
        blocks = self.pool.allocate(self.pulled_blocks_needed(num_tokens, first_blocks))
        req.tables = tables_of_pulled(blocks, num_tokens, self.block_size, first_blocks, self.rates)
        req.dropped = list(first_blocks)

    def release(self, req: Request) -> None:
        self.pool.free(req.held_block_ids)
        req.tables = [[] for _ in self.groups]
        req.dropped = [0] * self.num_groups
        req.open_shared = []
        req.block_copies = []

    def match(self, req: Request, hashes: Sequence[BlockHash]) -> int:
        """Take the longest cached prefix every group can resume from; its length in blocks.

        Resuming at block ``n`` needs every block ``< n`` of a full group, a compressed
        group's blocks of the entries closed before ``n * B``, and of a sliding group only
        the blocks the window of position ``n * B`` reaches. ``longest`` is where a cache
        that had kept every sliding block would resume (every other group whole, every
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
            if not group.is_sliding and group.rate == 1:
                full_len = min(
                    full_len, next((i for i, b in enumerate(found[g]) if b is None), num)
                )
        sliding = [g for g, group in enumerate(self.groups) if group.is_sliding]
        compressed = [g for g, group in enumerate(self.groups) if group.rate > 1]

        def entries_whole(n: int) -> bool:
            return all(None not in self._compressed(found[g], g, n) for g in compressed)

        longest = next(
            (
                n
                for n in range(full_len, 0, -1)
                if all(found[g][n - 1] is not None for g in sliding) and entries_whole(n)
            ),
            0,
        )
        for n in range(longest, 0, -1):
            firsts = [g.num_blocks_outside(n * size, size) for g in self.groups]
            if not entries_whole(n) or any(
                None in found[g][firsts[g] : n] for g in range(self.num_groups) if g in sliding
            ):
                continue
            for g, first in enumerate(firsts):
                group = self.groups[g]
                if group.rate > 1:
                    taken = [b for b in self._compressed(found[g], g, n) if b is not None]
                    if n * size // group.rate % size:  # the last block is open
                        req.open_shared.append((g, len(taken) - 1))
                else:
                    taken = [b for b in found[g][first:n] if b is not None]
                self.pool.take(taken)
                req.tables[g] = [NULL_BLOCK] * first + taken
                req.dropped[g] = first
            req.num_replayed_tokens = (longest - n) * size
            return n
        req.num_replayed_tokens = longest * size
        return 0

    def _compressed(self, found: list[int | None], g: int, n: int) -> list[int | None]:
        """A compressed group's blocks of the entries closed before block ``n``, as the
        prefix cache holds them: each full one under the token block that filled it, the
        last (maybe open) one under block ``n - 1``."""
        group = self.groups[g]
        last = group.last_entry(n, self.block_size)
        if last < 0:
            return []
        return [found[(j + 1) * group.rate - 1] for j in range(last)] + [found[n - 1]]

    def drop_outside_window(self, req: Request) -> None:
        """Return the blocks no later query of ``req`` can see, in each sliding group."""
        if not self._any_sliding:
            return
        for g, group in enumerate(self.groups):
            num = group.num_blocks_outside(req.num_computed_tokens, self.block_size)
            if num > req.dropped[g]:
                table = req.tables[g]
                self.pool.free(table[req.dropped[g] : num])
                table[req.dropped[g] : num] = [NULL_BLOCK] * (num - req.dropped[g])
                req.dropped[g] = num

    def register(self, req: Request, num_full: int) -> None:
        """Make the blocks of entries ``req.num_registered_blocks .. num_full`` findable."""
        for g, group in enumerate(self.groups):
            table = req.tables[g]
            for i in range(max(req.num_registered_blocks, req.dropped[g]), num_full):
                entry = group.last_entry(i + 1, self.block_size)
                if entry >= 0:
                    self.pool.register(table[entry], group_hash(req.block_hashes[i], g))

    def free_tail(self, req: Request) -> None:
        """Free the blocks past the last computed position (they held rejected drafts)."""
        for g, group in enumerate(self.groups):
            table = req.tables[g]
            keep = max(group.num_entries(req.num_computed_tokens, self.block_size), req.dropped[g])
            if len(table) > keep:
                self.pool.free(table[keep:])
                del table[keep:]
