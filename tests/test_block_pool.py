"""BlockPool: reference counts, prefix index, eviction, contiguous allocation."""

import pytest

from pdserve.common.engine.block_pool import BlockPool, NoFreeBlocks, hash_block, hash_blocks


def test_allocate_lowest_ids_first_gives_contiguous_runs() -> None:
    pool = BlockPool(8)
    assert pool.allocate(3) == [0, 1, 2]
    assert pool.allocate(2) == [3, 4]
    assert pool.num_free_blocks == 3


def test_free_returns_every_block_and_double_free_is_an_error() -> None:
    pool = BlockPool(4)
    blocks = pool.allocate(4)
    with pytest.raises(NoFreeBlocks):
        pool.allocate(1)
    pool.free(blocks)
    assert pool.num_free_blocks == 4
    with pytest.raises(RuntimeError, match="freed twice"):
        pool.free([blocks[0]])


def test_prefix_match_shares_blocks_and_counts_references() -> None:
    pool = BlockPool(6)
    tokens = list(range(8))
    hashes = hash_blocks(tokens, 4)
    blocks = pool.allocate(2)
    for b, h in zip(blocks, hashes, strict=True):
        pool.register(b, h)
    assert pool.match_prefix(hashes) == blocks
    assert [pool.ref_count(b) for b in blocks] == [2, 2]
    pool.free(blocks)
    pool.free(blocks)
    assert pool.num_free_blocks == 6
    # Freed but still cached: a later prompt finds them again.
    again = pool.match_prefix(hashes)
    assert again == blocks and pool.num_free_blocks == 4
    pool.free(again)


def test_cached_blocks_are_evicted_only_when_needed_lru_first() -> None:
    pool = BlockPool(3)
    a, b = pool.allocate(2)
    ha, hb = hash_block(None, [1]), hash_block(None, [2])
    pool.register(a, ha)
    pool.register(b, hb)
    pool.free([a])
    pool.free([b])
    assert pool.allocate(1) == [2]  # plain free blocks go first
    assert pool.allocate(1) == [a]  # then the least recently freed cached block
    assert pool.count_cached_prefix([ha]) == 0
    assert pool.count_cached_prefix([hb]) == 1


def test_hash_chain_depends_on_the_whole_prefix() -> None:
    one = hash_blocks([1, 2, 3, 4, 5, 6], 3)
    two = hash_blocks([9, 2, 3, 4, 5, 6], 3)
    assert len(one) == 2 and one[0] != two[0] and one[1] != two[1]
    assert hash_blocks([1, 2, 3, 4, 5, 6, 7], 3) == one  # a partial block has no hash
    assert hash_blocks([4, 5, 6], 3, parent=one[0]) == one[1:]


def test_prefix_caching_off_never_matches() -> None:
    pool = BlockPool(2, enable_prefix_caching=False)
    [b] = pool.allocate(1)
    h = hash_block(None, [1])
    pool.register(b, h)
    assert pool.match_prefix([h]) == []
    pool.free([b])
    assert pool.num_free_blocks == 2
