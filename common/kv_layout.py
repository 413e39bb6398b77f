"""KVLayout (pure): the shape of one rank's paged cache and the bytes of any part of it.

Layout ``[num_blocks, num_layers, 2, num_kv_heads, block_size, head_dim]``: a block holds
every layer's K and V (block-major), so a run of adjacent blocks is one contiguous byte
range -- one NIXL descriptor per run. Inside a block, heads are the outer dimension (HND),
so a tensor-parallel head slice of one (layer, K|V) is contiguous too. Descriptors for
transfers and the kernels' indexing both derive from this class.
"""

from __future__ import annotations

import msgspec

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
        return (self.num_blocks, self.num_layers, 2, self.num_kv_heads, self.block_size, self.head_dim)

    @property
    def itemsize(self) -> int:
        return DTYPE_SIZES[self.dtype]

    @property
    def head_bytes(self) -> int:
        """One head of one (block, layer, K|V): block_size x head_dim elements."""
        return self.block_size * self.head_dim * self.itemsize

    @property
    def block_bytes(self) -> int:
        return self.num_layers * 2 * self.num_kv_heads * self.head_bytes

    @property
    def total_bytes(self) -> int:
        return self.num_blocks * self.block_bytes

    @property
    def bytes_per_token(self) -> int:
        return self.block_bytes // self.block_size

    def block_run(self, first_block: int, num_blocks: int) -> tuple[int, int]:
        """(offset, length) in bytes of ``num_blocks`` adjacent blocks, all layers."""
        return first_block * self.block_bytes, num_blocks * self.block_bytes

    def head_slice(self, block: int, layer: int, kv: int, first_head: int, num_heads: int) -> tuple[int, int]:
        """(offset, length) of heads [first_head, first_head + num_heads) of one block's
        layer and K (kv=0) or V (kv=1)."""
        offset = (((block * self.num_layers + layer) * 2 + kv) * self.num_kv_heads + first_head) * self.head_bytes
        return offset, num_heads * self.head_bytes

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
