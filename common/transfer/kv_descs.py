"""NIXL descriptor arithmetic of a KV cache (pure numpy): the prepared lists' rows and the
index lists of a pull.

A cache is an array of (head, block) units (common/engine/kv_layout.py); each side prepares a
list with one row per unit, once, so that a pull is two index lists into them and one
``make_prepped_xfer``. NIXL merges index pairs whose local AND remote rows are both
adjacent into one descriptor (its default merging; the tests check NIXL's own count):
``num_runs`` predicts the result. Block-major caches also prepare one row per whole block.
"""

from __future__ import annotations

import numpy as np

from pdserve.common.engine.kv_layout import KVLayout


def coalesce(remote_ids: list[int], local_ids: list[int]) -> list[tuple[int, int, int]]:
    """Runs (remote_first, local_first, count) where both sides' ids are consecutive:
    each run is one descriptor of count * block_bytes."""
    runs: list[tuple[int, int, int]] = []
    for r, lo in zip(remote_ids, local_ids, strict=True):
        if runs:
            rf, lf, n = runs[-1]
            if rf + n == r and lf + n == lo:
                runs[-1] = (rf, lf, n + 1)
                continue
        runs.append((r, lo, 1))
    return runs


def head_block_descs(base: int, layout: KVLayout, device_id: int) -> np.ndarray:
    """[H * N, 3] (address, length, device) rows, one per (head, block) unit in memory
    order: row ``layout.unit_index(head, block)``."""
    count = layout.num_kv_heads * layout.num_blocks
    descs = np.empty((count, 3), dtype=np.uint64)
    descs[:, 0] = base + np.arange(count, dtype=np.uint64) * layout.head_block_bytes
    descs[:, 1] = layout.head_block_bytes
    descs[:, 2] = device_id
    return descs


def block_descs(base: int, layout: KVLayout, device_id: int) -> np.ndarray | None:
    """Block order only: [N, 3] rows, one per block with all its heads (row = block id)."""
    if layout.order != "block":
        return None
    descs = np.empty((layout.num_blocks, 3), dtype=np.uint64)
    descs[:, 0] = base + np.arange(layout.num_blocks, dtype=np.uint64) * layout.block_bytes
    descs[:, 1] = layout.block_bytes
    descs[:, 2] = device_id
    return descs


def num_runs(remote_idx: np.ndarray, local_idx: np.ndarray) -> int:
    """Descriptors after merging: index pairs where both sides step by exactly one continue a run."""
    if not len(local_idx):
        return 0
    cont = (remote_idx[1:] - remote_idx[:-1] == 1) & (local_idx[1:] - local_idx[:-1] == 1)
    return int(len(local_idx) - np.count_nonzero(cont))


def unit_indices(
    ids: np.ndarray, layout: KVLayout, first_head: int, num_heads: int, by_block: bool
) -> np.ndarray:
    """Unit indices (KVLayout.unit_index) of heads [first_head, +num_heads) of blocks ``ids``,
    enumerated block by block (``by_block``) or head by head. Both sides of a READ must use
    one enumeration, as NIXL pairs the two index lists element by element."""
    heads = np.arange(first_head, first_head + num_heads, dtype=np.int32)
    if layout.order == "block":
        units = ids[:, None] * layout.num_kv_heads + heads[None, :]  # [blocks, heads]
    else:
        units = (heads[:, None] * layout.num_blocks + ids[None, :]).T  # [blocks, heads]
    return (units if by_block else units.T).ravel()
