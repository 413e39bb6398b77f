"""Zigzag split of prefill tokens for prefill context parallelism (pure).

A step's new tokens of each sequence are cut into 2N pieces; rank r computes pieces r
and 2N-1-r, which balances causal attention work (early pieces are cheap, late ones
dear). Piece sizes differ by at most one, the remainder going to the last pieces, so the
sequence's last token always lies in piece 2N-1, which rank 0 holds: rank 0 has every
hidden state that is sampled from, and nothing needs gathering for logits.
"""

from __future__ import annotations


def piece_bounds(num_tokens: int, num_ranks: int) -> list[tuple[int, int]]:
    """[start, end) of each of the 2N pieces of ``num_tokens`` tokens."""
    num_pieces = 2 * num_ranks
    base, extra = divmod(num_tokens, num_pieces)
    sizes = [base + (1 if i >= num_pieces - extra else 0) for i in range(num_pieces)]
    bounds, start = [], 0
    for size in sizes:
        bounds.append((start, start + size))
        start += size
    return bounds


def rank_pieces(num_tokens: int, num_ranks: int, rank: int) -> list[tuple[int, int]]:
    """The non-empty pieces (offsets into the step's tokens) that ``rank`` computes."""
    bounds = piece_bounds(num_tokens, num_ranks)
    mine = [bounds[rank], bounds[2 * num_ranks - 1 - rank]]
    return [b for b in mine if b[1] > b[0]]
