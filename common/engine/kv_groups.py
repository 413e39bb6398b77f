"""KV cache groups (pure): a model's layers by attention kind, and what each must keep.

A full-attention layer reads every earlier token, so its group keeps every block of a
sequence. A sliding layer of window W reads only keys ``p - W < k <= p``: once a block lies
wholly before the window of the next query, no later step reads it, and the group hands it
back to the pool while the sequence runs. Its table entry becomes ``NULL_BLOCK`` so that
entry ``i`` still covers positions ``i * block_size ..`` (the kernels start at the window's
first block and never read it).

Today one block holds every layer of a sequence's tokens (common/engine/kv_layout.py), so
blocks can be returned only when every layer is sliding with one window (Mistral): the
cache is then one sliding group, bounded to ``ceil(W / block_size) + 1`` blocks per
decoding sequence, and a prefill hands decode only the blocks still inside the window
(``KVHandle.first_block``). A model mixing full and sliding layers (Qwen2
``max_window_layers``) has two groups here but keeps one table until the cache is split
per group (docs/models.md lists what remains).
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

# A table entry whose block left the sliding window and went back to the pool.
NULL_BLOCK = -1


class KVCacheGroup(msgspec.Struct, frozen=True, kw_only=True):
    layers: tuple[int, ...]
    sliding_window: int | None = None  # None: full attention

    @property
    def is_sliding(self) -> bool:
        return self.sliding_window is not None

    def num_blocks_outside(self, num_computed_tokens: int, block_size: int) -> int:
        """Leading blocks that no query at a position >= ``num_computed_tokens`` sees: the
        last position of block i, ``(i + 1) * B - 1``, is at most ``next - W``."""
        if self.sliding_window is None:
            return 0
        return max(0, (num_computed_tokens - self.sliding_window + 1) // block_size)

    def max_blocks(self, num_tokens: int, block_size: int, chunk: int = 1) -> int:
        """The most blocks a sequence of ``num_tokens`` holds here, computing ``chunk``
        tokens a step: a window of W keys plus the chunk spans ``ceil((W - 1 + chunk) /
        B) + 1`` blocks at most (decode, chunk 1: ``ceil(W / B) + 1``)."""
        full = -(-num_tokens // block_size)
        if self.sliding_window is None:
            return full
        return min(full, -(-(self.sliding_window - 1 + chunk) // block_size) + 1)


def kv_cache_groups(layer_windows: Sequence[int | None]) -> list[KVCacheGroup]:
    """The layers grouped by window (None: full attention), in order of first layer."""
    layers: dict[int | None, list[int]] = {}
    for i, window in enumerate(layer_windows):
        layers.setdefault(window, []).append(i)
    return [KVCacheGroup(layers=tuple(ls), sliding_window=w) for w, ls in layers.items()]
