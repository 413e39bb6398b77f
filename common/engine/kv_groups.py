"""KV cache groups (pure): a model's layers by attention kind, and what each must keep.

A full-attention layer reads every earlier token, so its group keeps every block of a
sequence. A sliding layer of window W reads only keys ``p - W < k <= p``: once a block lies
wholly before the window of the next query, no later step reads it, and the group hands it
back to the pool while the sequence runs. Its table entry becomes ``NULL_BLOCK`` so that
entry ``i`` still covers positions ``i * block_size ..`` (the kernels start at the window's
first block and never read it).

A cache is split into groups of equal page size, as vLLM's hybrid KV cache manager does:
the layers of each attention kind are cut into groups of ``page_layers`` layers (the
smallest kind's count; a larger kind becomes several groups, its last one padded), and a
block of the one shared pool holds the K/V of one group's layers for ``block_size``
tokens. Layer ``l`` keeps its K/V in slot ``j`` of the blocks of its group ``g``
(common/model/decoder.py ``layer_slots``); the cache tensor is ``[N, page_layers, 2, H, B, D]``. Each request has
one block table per group (``Request.tables``): a full group keeps every block, a sliding
group returns those behind its window. A model with one kind (Llama: full; Mistral: one
window) is one group of every layer, the cache and tables as before groups existed.

A compressed group (``rate`` m > 1: DeepSeek-V4's compressed entries, one per m tokens)
holds in a block the entries of ``block_size`` windows, so its table entry i covers
positions ``i * B * m ..`` and its table is ``1 / m`` as long; it keeps every block (its
entries are read for as long as the sequence runs). ``cache_groups`` names a model's.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from pdserve.common.model.checkpoint.config import ModelConfig
from pdserve.common.model.family_api import family_for

# A table entry whose block left the sliding window and went back to the pool.
NULL_BLOCK = -1


class KVCacheGroup(msgspec.Struct, frozen=True, kw_only=True):
    layers: tuple[int, ...]
    sliding_window: int | None = None  # None: full attention
    rate: int = 1  # tokens a slot stands for: 1, or a compressed group's tokens per entry

    @property
    def is_sliding(self) -> bool:
        return self.sliding_window is not None

    def num_entries(self, num_tokens: int, block_size: int) -> int:
        """Table entries covering ``num_tokens`` positions (a compressed group: the blocks
        its entries of those positions' windows take, the last one open)."""
        return -(-num_tokens // (block_size * self.rate))

    def last_entry(self, num_full: int, block_size: int) -> int:
        """The table entry holding the last slot written once ``num_full`` token blocks are
        computed (-1: none yet): block ``num_full - 1``, or a compressed group's block of
        its last closed window."""
        closed = num_full * block_size // self.rate
        return (closed - 1) // block_size

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
        full = self.num_entries(num_tokens, block_size)
        if self.sliding_window is None:
            return full
        return min(full, -(-(self.sliding_window - 1 + chunk) // block_size) + 1)


def kv_cache_groups(layer_windows: Sequence[int | None]) -> list[KVCacheGroup]:
    """The layers grouped by window (None: full attention), in order of first layer."""
    layers: dict[int | None, list[int]] = {}
    for i, window in enumerate(layer_windows):
        layers.setdefault(window, []).append(i)
    return [KVCacheGroup(layers=tuple(ls), sliding_window=w) for w, ls in layers.items()]


def page_groups(layer_windows: Sequence[int | None]) -> list[KVCacheGroup]:
    """The cache's groups: each kind's layers (``kv_cache_groups``) cut into groups of
    ``page_layers`` layers, so one block of the pool serves any group. One kind: one group."""
    return pages_of(kv_cache_groups(layer_windows))


def cache_groups(cfg: ModelConfig) -> list[KVCacheGroup]:
    """The KV cache groups of a model: the kinds its family names (common/model/
    family_api.py ``cache_kinds``: by window, or DeepSeek-V4's window of every layer plus
    its compressed entries), cut into pages."""
    kinds = family_for(cfg).cache_kinds(cfg)
    return pages_of(
        [
            KVCacheGroup(layers=layers, sliding_window=window, rate=rate)
            for layers, window, rate in kinds
        ]
    )


def pages_of(kinds: Sequence[KVCacheGroup]) -> list[KVCacheGroup]:
    """Each kind's layers cut into groups of the smallest kind's layer count."""
    if not kinds:
        return [KVCacheGroup(layers=())]
    size = min(len(k.layers) for k in kinds)
    groups: list[KVCacheGroup] = []
    for kind in kinds:
        for start in range(0, len(kind.layers), size):
            part = kind.layers[start : start + size]
            groups.append(msgspec.structs.replace(kind, layers=part))
    return groups


def page_layers(groups: Sequence[KVCacheGroup]) -> int:
    """Layers one block holds: the largest group's (the others leave slots unused)."""
    return max((len(g.layers) for g in groups), default=0)


def num_pulled_blocks(
    num_tokens: int, block_size: int, first_blocks: Sequence[int], rates: Sequence[int] = ()
) -> int:
    """Blocks a KV handle lists: each group's table entries from its first kept one
    (``rates``: each group's tokens per slot; none: all 1)."""
    rates = list(rates) or [1] * len(first_blocks)
    return sum(
        -(-num_tokens // (block_size * rate)) - first
        for first, rate in zip(first_blocks, rates, strict=True)
    )


def tables_of_pulled(
    block_ids: Sequence[int],
    num_tokens: int,
    block_size: int,
    first_blocks: Sequence[int],
    rates: Sequence[int] = (),
) -> list[list[int]]:
    """The block table of each group from a handle's flat ``block_ids`` (group after group,
    each from its table entry ``first_blocks[g]``; the entries before are NULL_BLOCK)."""
    rates = list(rates) or [1] * len(first_blocks)
    tables: list[list[int]] = []
    at = 0
    for first, rate in zip(first_blocks, rates, strict=True):
        num = -(-num_tokens // (block_size * rate)) - first
        tables.append([NULL_BLOCK] * first + list(block_ids[at : at + num]))
        at += num
    if at != len(block_ids):
        raise ValueError(f"{len(block_ids)} blocks for tables that hold {at}")
    return tables


def group_hash(block_hash: bytes, group: int) -> bytes:
    """The prefix-cache key of a block of ``group``: group 0 keeps the plain chained hash
    (what routers compare), the others are told apart by a suffix."""
    return block_hash if group == 0 else block_hash + group.to_bytes(2, "little")
