"""KVLayout (pure): the shape of one rank's paged cache and the bytes of any part of it.

The unit of a transfer is one KV head of one block: every layer's K and V of it
(``head_block_bytes``). The storage tensor is an array of these units in one of two orders:

* ``order="head"``: ``[num_kv_heads, num_blocks, num_layers, 2, block_size, head_dim]``.
  For one KV head a run of adjacent blocks is one contiguous byte range, so a reader that
  wants a slice of the heads (a decode rank of another tensor-parallel size) reads a
  request with ``runs x heads`` NIXL descriptors, never ``blocks x layers x heads``.
* ``order="block"``: ``[num_blocks, num_kv_heads, num_layers, 2, block_size, head_dim]``.
  A run of adjacent blocks with all their heads is one byte range: a reader that wants
  every head (equal TP on both sides) reads a request with ``runs`` descriptors. On the
  H200 a 1B-shaped 8k-token pull went from 8 descriptors to 1 (benchmarks/README.md).

A deployment picks ``block`` when every decode instance has the prefill TP size, ``head``
otherwise (``DeploymentConfig.engine_for``). The two sides may even differ: descriptors
are computed per side from each layout, and only pairs contiguous on both sides merge.

The model and the kernels see the logical view ``[num_blocks, num_layers, 2, num_kv_heads,
block_size, head_dim]`` (``shape``), a permutation of the storage; kernels take strides.
Descriptors for transfers and the kernels' indexing both derive from this class.

An MLA model's cache (common/model/layers/mla.py) is this layout with one "KV head" holding the
latent, ``num_kv_parts = 1`` (the latent is both key and value) and ``head_dim`` the
latent's width in elements of ``dtype``: ``[N, L, 1, 1, B, kv_lora_rank + rope]``. How the
bytes of one token's latent are laid out is ``LatentFormat`` (common/engine/latent_format.py);
with ``--kv-cache-dtype fp8`` the dtype is uint8 and ``head_dim`` the 656 bytes of a token's
fp8_ds_mla record.
"""

from __future__ import annotations

from typing import Literal

import msgspec

# permute() orders between the storage and the logical view [N, L, 2, H, B, D], per order:
# head-major storage [H, N, L, 2, B, D], block-major storage [N, H, L, 2, B, D].
LOGICAL_FROM_STORAGE = (1, 2, 3, 0, 4, 5)
STORAGE_FROM_LOGICAL = (3, 0, 1, 2, 4, 5)
BLOCK_LOGICAL_FROM_STORAGE = (0, 2, 3, 1, 4, 5)
BLOCK_STORAGE_FROM_LOGICAL = (0, 3, 1, 2, 4, 5)
ORDERS = ("head", "block")

# uint8: an MLA latent cache of fp8_ds_mla records (common/engine/latent_format.py)
DTYPE_SIZES = {"float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1, "uint8": 1}


class KVLayout(msgspec.Struct, frozen=True, kw_only=True):
    num_blocks: int
    num_layers: int
    num_kv_heads: int
    block_size: int
    head_dim: int
    dtype: str  # one of DTYPE_SIZES: the stored K/V dtype (float8_e4m3fn: --kv-cache-dtype fp8)
    order: Literal["head", "block"] = "head"  # storage order of the (head, block) units
    # fp8: stored = value / scale, one fp32 scale per tensor for every K (and every V) of the
    # cache (common/engine/kv_quant.py). Part of the layout: the handshake compares them, so
    # a decode never reads bytes quantized with another scale. 1.0 for other dtypes.
    k_scale: float = 1.0
    v_scale: float = 1.0
    num_kv_parts: int = 2  # K and V; 1 for an MLA latent (key and value in one)

    @property
    def shape(self) -> tuple[int, int, int, int, int, int]:
        """Logical shape, as the model indexes it: [N, L, 2, H_kv, B, D] (MLA: 1 part)."""
        return (
            self.num_blocks,
            self.num_layers,
            self.num_kv_parts,
            self.num_kv_heads,
            self.block_size,
            self.head_dim,
        )

    @property
    def storage_shape(self) -> tuple[int, int, int, int, int, int]:
        """Memory order: [H_kv, N, L, 2, B, D] (head) or [N, H_kv, L, 2, B, D] (block);
        ``storage.permute(self.logical_from_storage)`` is the logical view."""
        inner = (self.num_layers, self.num_kv_parts, self.block_size, self.head_dim)
        if self.order == "block":
            return (self.num_blocks, self.num_kv_heads, *inner)
        return (self.num_kv_heads, self.num_blocks, *inner)

    @property
    def logical_from_storage(self) -> tuple[int, ...]:
        return BLOCK_LOGICAL_FROM_STORAGE if self.order == "block" else LOGICAL_FROM_STORAGE

    @property
    def storage_from_logical(self) -> tuple[int, ...]:
        return BLOCK_STORAGE_FROM_LOGICAL if self.order == "block" else STORAGE_FROM_LOGICAL

    def unit_index(self, head: int, block: int) -> int:
        """Position of the (head, block) unit in storage, in units of head_block_bytes."""
        if self.order == "block":
            return block * self.num_kv_heads + head
        return head * self.num_blocks + block

    @property
    def is_fp8(self) -> bool:
        return self.dtype == "float8_e4m3fn"

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
        return self.num_layers * self.num_kv_parts * self.head_bytes

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
        """(offset, length) in bytes of KV head ``head`` of ``num_blocks`` adjacent blocks
        (head order; in block order only a single block is one range)."""
        if self.order == "block" and num_blocks != 1:
            raise ValueError("in block order one head of several blocks is not one byte range")
        return self.unit_index(
            head, first_block
        ) * self.head_block_bytes, num_blocks * self.head_block_bytes
