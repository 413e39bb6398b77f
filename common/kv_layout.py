"""KVLayout (pure): the shape of one rank's paged cache and the bytes of any part of it.

Memory order (the storage tensor): ``[num_kv_heads, num_blocks, num_layers, 2, block_size,
head_dim]``. Heads are outermost, then blocks, and one block of one head holds every
layer's K and V. So for one KV head a run of adjacent blocks is one contiguous byte range
-- one NIXL descriptor per (head, run) -- whatever head slice a reader of another tensor-
parallel size wants: a decode rank reads its heads of a request with ``runs x heads``
descriptors, never ``blocks x layers x heads``.

The model and the kernels see the logical view ``[num_blocks, num_layers, 2, num_kv_heads,
block_size, head_dim]`` (``shape``), a permutation of the storage; kernels take strides.
Descriptors for transfers and the kernels' indexing both derive from this class.
"""

from __future__ import annotations

import msgspec

# permute() orders between the storage [H, N, L, 2, B, D] and the logical view [N, L, 2, H, B, D]
LOGICAL_FROM_STORAGE = (1, 2, 3, 0, 4, 5)
STORAGE_FROM_LOGICAL = (3, 0, 1, 2, 4, 5)

DTYPE_SIZES = {"float32": 4, "bfloat16": 2, "float16": 2}


class KVLayout(msgspec.Struct, frozen=True, kw_only=True):
    num_blocks: int
    num_layers: int
    num_kv_heads: int
    block_size: int
    head_dim: int
    dtype: str  # one of DTYPE_SIZES

    @property
    def shape(self) -> tuple[int, int, int, int, int, int]:
        """Logical shape, as the model indexes it: [N, L, 2, H_kv, B, D]."""
        return (self.num_blocks, self.num_layers, 2, self.num_kv_heads, self.block_size, self.head_dim)

    @property
    def storage_shape(self) -> tuple[int, int, int, int, int, int]:
        """Memory order: [H_kv, N, L, 2, B, D]; ``storage.permute(LOGICAL_FROM_STORAGE)``
        is the logical view."""
        return (self.num_kv_heads, self.num_blocks, self.num_layers, 2, self.block_size, self.head_dim)

    @property
    def itemsize(self) -> int:
        return DTYPE_SIZES[self.dtype]

    @property
    def head_bytes(self) -> int:
        """One head of one (block, layer, K|V): block_size x head_dim elements."""
        return self.block_size * self.head_dim * self.itemsize

    @property
    def head_block_bytes(self) -> int:
        """One KV head of one block, all layers, K and V: the unit of a transfer."""
        return self.num_layers * 2 * self.head_bytes

    @property
    def block_bytes(self) -> int:
        return self.num_kv_heads * self.head_block_bytes

    @property
    def total_bytes(self) -> int:
        return self.num_blocks * self.block_bytes

    @property
    def bytes_per_token(self) -> int:
        return self.block_bytes // self.block_size

    def head_run(self, head: int, first_block: int, num_blocks: int) -> tuple[int, int]:
        """(offset, length) in bytes of KV head ``head`` of ``num_blocks`` adjacent blocks."""
        return (head * self.num_blocks + first_block) * self.head_block_bytes, num_blocks * self.head_block_bytes

    @staticmethod
    def runs(block_ids: list[int]) -> list[tuple[int, int]]:
        """Maximal runs of consecutive ids as (first, count), in the order given."""
        runs: list[tuple[int, int]] = []
        for block in block_ids:
            if runs and runs[-1][0] + runs[-1][1] == block:
                runs[-1] = (runs[-1][0], runs[-1][1] + 1)
            else:
                runs.append((block, 1))
        return runs
