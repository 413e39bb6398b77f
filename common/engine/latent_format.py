"""LatentFormat (pure): how one token's MLA latent is laid out in the KV cache.

An MLA layer caches, per token, the compressed KV latent (``kv_lora_rank`` values, after
``kv_a_layernorm``) followed by the rotated key part shared by all heads
(``qk_rope_head_dim`` values): no heads, no separate K and V. The cache stores it as one
"KV head" of ``elements`` values of ``storage_dtype`` per token and layer (``KVLayout`` with
``num_kv_parts = 1``), so block bytes, descriptors and pulls follow from ``KVLayout`` as for
any other model.

``auto`` keeps both parts in the model's dtype: ``kv_lora_rank + rope`` elements. A
quantized format plugs in as another ``kind`` with its own ``sections`` and
``storage_dtype`` (vLLM's ``fp8_ds_mla``: 512 fp8 latent values, four fp32 scales, 64 bf16
rope values, 656 bytes a token, stored as uint8); the model then writes and reads the
latent through that format's quantize/dequantize helpers.
"""

from __future__ import annotations

from typing import NamedTuple

import msgspec

from pdserve.common.engine.kv_layout import DTYPE_SIZES
from pdserve.common.model.config import ModelConfig


class Section(NamedTuple):
    """``num_values`` values of ``dtype`` at byte ``offset`` of a token's latent."""

    name: str
    offset: int
    num_values: int
    dtype: str


class LatentFormat(msgspec.Struct, frozen=True, kw_only=True):
    kv_lora_rank: int
    rope_dim: int
    dtype: str  # the model's dtype (one of DTYPE_SIZES)
    kind: str = "auto"

    def __post_init__(self) -> None:
        if self.kind != "auto":
            raise ValueError(f"latent cache format {self.kind!r} is not supported (auto)")
        if self.dtype not in DTYPE_SIZES:
            raise ValueError(f"latent cache dtype {self.dtype!r}: one of {sorted(DTYPE_SIZES)}")

    @property
    def sections(self) -> tuple[Section, ...]:
        """The parts of one token's latent, in byte order."""
        size = DTYPE_SIZES[self.dtype]
        return (
            Section("latent", 0, self.kv_lora_rank, self.dtype),
            Section("rope", self.kv_lora_rank * size, self.rope_dim, self.dtype),
        )

    @property
    def token_bytes(self) -> int:
        """Bytes of one token's latent in one layer."""
        last = self.sections[-1]
        return last.offset + last.num_values * DTYPE_SIZES[last.dtype]

    @property
    def storage_dtype(self) -> str:
        """The cache tensor's dtype (``KVLayout.dtype``)."""
        return self.dtype

    @property
    def elements(self) -> int:
        """Values of ``storage_dtype`` per token and layer (``KVLayout.head_dim``)."""
        return self.token_bytes // DTYPE_SIZES[self.storage_dtype]


def cache_head(cfg: ModelConfig, dtype: str) -> tuple[int, int, str]:
    """(head_dim, num_kv_parts, dtype) of ``KVLayout`` for a model: its K/V heads, or for
    MLA one latent row per token in ``LatentFormat``."""
    if not cfg.is_mla:
        return cfg.head_dim, 2, dtype
    fmt = LatentFormat(kv_lora_rank=cfg.kv_lora_rank, rope_dim=cfg.qk_rope_head_dim, dtype=dtype)
    return fmt.elements, 1, fmt.storage_dtype
