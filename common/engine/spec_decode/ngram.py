"""N-gram (prompt lookup) proposer: the tokens that followed the latest earlier occurrence
of the context's last n tokens, n from ``prompt_lookup_max`` down to ``prompt_lookup_min``.

It always proposes exactly ``k`` tokens (the step's shape is fixed): the copy continues
past the context's end over the tokens it proposed (a repeating text keeps repeating),
and a context with no match proposes its last token ``k`` times (verified like any
draft, so it costs nothing in correctness)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def ngram_propose(tokens: Sequence[int], k: int, lookup_min: int, lookup_max: int) -> list[int]:
    """``k`` draft tokens for a context ``tokens`` (prompt + output, non-empty)."""
    ctx = np.asarray(tokens, dtype=np.int64)
    num = len(ctx)
    for n in range(min(lookup_max, num - 1), lookup_min - 1, -1):
        suffix = ctx[num - n :]
        # windows of the context before its own suffix: start i covers ctx[i : i + n]
        windows = np.lib.stride_tricks.sliding_window_view(ctx[: num - 1], n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n  # the token after the latest earlier occurrence
            out = list(tokens)
            for j in range(k):
                out.append(out[start + j])
            return out[num:]
    return [int(ctx[-1])] * k
