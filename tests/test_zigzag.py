"""Zigzag pieces: a partition, balanced, and the last token always on rank 0."""

import pytest

from pdserve.common.parallel.zigzag import piece_bounds, rank_pieces


@pytest.mark.parametrize("num_ranks", [1, 2, 4, 8])
@pytest.mark.parametrize("num_tokens", [1, 2, 3, 7, 8, 9, 64, 1000, 4097])
def test_pieces_partition_the_tokens_and_rank_0_holds_the_last(
    num_tokens: int, num_ranks: int
) -> None:
    covered = sorted(
        p
        for r in range(num_ranks)
        for piece in rank_pieces(num_tokens, num_ranks, r)
        for p in range(*piece)
    )
    assert covered == list(range(num_tokens))
    assert any(end == num_tokens for _, end in rank_pieces(num_tokens, num_ranks, 0))
    sizes = [e - s for s, e in piece_bounds(num_tokens, num_ranks)]
    assert max(sizes) - min(sizes) <= 1


def test_each_rank_gets_a_cheap_and_a_dear_piece() -> None:
    assert rank_pieces(8, 2, 0) == [(0, 2), (6, 8)]
    assert rank_pieces(8, 2, 1) == [(2, 4), (4, 6)]
