"""LatentFormat (pure): how one token's MLA latent is laid out in the KV cache.

An MLA layer caches, per token, the compressed KV latent (``kv_lora_rank`` values, after
``kv_a_layernorm``) followed by the rotated key part shared by all heads
(``qk_rope_head_dim`` values): no heads, no separate K and V. The cache stores it as one
"KV head" of ``elements`` values of ``storage_dtype`` per token and layer (``KVLayout`` with
``num_kv_parts = 1``), so block bytes, descriptors and pulls follow from ``KVLayout`` as for
any other model.

``auto`` keeps both parts in the model's dtype: ``kv_lora_rank + rope`` elements.
``fp8_ds_mla`` (``--kv-cache-dtype fp8``) is vLLM's record: the latent in fp8, one fp32
scale per 128 latent values, the rope part in bf16 (DeepSeek-V3: 512 + 16 + 128 = 656
bytes a token), stored as uint8 so that one "element" is one byte; the kernels quantize
on write and dequantize on read (kernels/fp8_ds_mla.py).

DeepSeek-V3.2 (``index_dim`` > 0) appends its lightning indexer's key to the row, in the
model's dtype: ``kv_lora_rank + rope + index_head_dim`` elements (512 + 64 + 128 in V3.2).
One row per token keeps everything a block moves in one record, so prefix caching, NIXL
pulls and PCP replicas carry the indexer's keys with the latent unchanged. With
``fp8_ds_mla`` the key follows the 656-byte record in vLLM's fp8 form of it: fp8 values,
then one float32 power-of-two scale per 128 (788 bytes a token in V3.2; vLLM keeps these
132 bytes in a cache of their own, docs/models.md).
"""

from __future__ import annotations

from typing import NamedTuple

import msgspec

from pdserve.common.engine.kv_layout import DTYPE_SIZES
from pdserve.common.model.checkpoint.config import ModelConfig
from pdserve.common.model.deepseek.dsv4_config import CSA
from pdserve.common.model.family_api import family_for

KINDS = ("auto", "fp8_ds_mla")
FP8_DTYPE = "float8_e4m3fn"  # EngineConfig's name for --kv-cache-dtype fp8
DS_MLA_TILE = 128  # latent values per fp32 scale (kernels/fp8_ds_mla.py's TILE)
INDEX_TILE = 128  # indexer key values per fp32 scale (kernels/fp8_ds_mla.py's KEY_TILE)
V4_TILE = 64  # DeepSeek-V4 K=V nope values per ue8m0 scale byte (kernels/fp8_ds_v4.py's TILE)


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
    index_dim: int = 0  # DeepSeek-V3.2: the indexer's key, after the rope part

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(
                f"latent cache format {self.kind!r} is not supported ({', '.join(KINDS)})"
            )
        if self.kind == "fp8_ds_mla" and self.index_dim % INDEX_TILE:
            raise ValueError(
                f"the fp8 indexer key needs index_head_dim to be a multiple of {INDEX_TILE}, "
                f"the model's is {self.index_dim}"
            )
        if self.dtype not in DTYPE_SIZES:
            raise ValueError(f"latent cache dtype {self.dtype!r}: one of {sorted(DTYPE_SIZES)}")
        if self.kind == "fp8_ds_mla" and (
            self.kv_lora_rank < DS_MLA_TILE or self.kv_lora_rank % DS_MLA_TILE
        ):
            raise ValueError(
                f"the fp8_ds_mla latent cache needs kv_lora_rank to be a multiple of "
                f"{DS_MLA_TILE}, the model's is {self.kv_lora_rank}"
            )

    @property
    def sections(self) -> tuple[Section, ...]:
        """The parts of one token's latent, in byte order."""
        if self.kind == "fp8_ds_mla":
            num_scales = self.kv_lora_rank // DS_MLA_TILE
            rope_at = self.kv_lora_rank + 4 * num_scales
            record: tuple[Section, ...] = (
                Section("latent", 0, self.kv_lora_rank, FP8_DTYPE),
                Section("scales", self.kv_lora_rank, num_scales, "float32"),
                Section("rope", rope_at, self.rope_dim, "bfloat16"),
            )
            if self.index_dim:
                index_at = rope_at + 2 * self.rope_dim
                record += (
                    Section("index", index_at, self.index_dim, FP8_DTYPE),
                    Section(
                        "index_scales",
                        index_at + self.index_dim,
                        self.index_dim // INDEX_TILE,
                        "float32",
                    ),
                )
            return record
        size = DTYPE_SIZES[self.dtype]
        sections: tuple[Section, ...] = (
            Section("latent", 0, self.kv_lora_rank, self.dtype),
            Section("rope", self.kv_lora_rank * size, self.rope_dim, self.dtype),
        )
        if self.index_dim:
            end = (self.kv_lora_rank + self.rope_dim) * size
            sections += (Section("index", end, self.index_dim, self.dtype),)
        return sections

    @property
    def token_bytes(self) -> int:
        """Bytes of one token's latent in one layer."""
        last = self.sections[-1]
        return last.offset + last.num_values * DTYPE_SIZES[last.dtype]

    @property
    def storage_dtype(self) -> str:
        """The cache tensor's dtype (``KVLayout.dtype``): uint8 for fp8_ds_mla records."""
        return "uint8" if self.kind == "fp8_ds_mla" else self.dtype

    @property
    def elements(self) -> int:
        """Values of ``storage_dtype`` per token and layer (``KVLayout.head_dim``)."""
        return self.token_bytes // DTYPE_SIZES[self.storage_dtype]


def latent_format(cfg: ModelConfig, dtype: str, kv_cache_dtype: str | None = None) -> LatentFormat:
    """The latent format of an MLA model in ``dtype`` whose KV cache stores
    ``kv_cache_dtype`` (``EngineConfig.kv_cache_torch_dtype_name``; fp8: fp8_ds_mla)."""
    if kv_cache_dtype not in (None, dtype, FP8_DTYPE):
        raise ValueError(f"an MLA latent cache stores {dtype} or fp8, not {kv_cache_dtype}")
    kind = "fp8_ds_mla" if kv_cache_dtype == FP8_DTYPE else "auto"
    return LatentFormat(
        kv_lora_rank=cfg.kv_lora_rank,
        rope_dim=cfg.qk_rope_head_dim,
        dtype=dtype,
        kind=kind,
        index_dim=cfg.index_head_dim,
    )


def cache_head(
    cfg: ModelConfig, dtype: str, kv_cache_dtype: str | None = None
) -> tuple[int, int, str]:
    """(head_dim, num_kv_parts, dtype) of ``KVLayout`` for a model whose KV cache stores
    ``kv_cache_dtype`` (None: the model's ``dtype``): its K/V heads, or for MLA one latent
    row per token in ``LatentFormat`` (V3.2: with the indexer's key), or DeepSeek-V4's row;
    which of them the family says (common/model/family_api.py ``row_kind``). The one
    definition of a cache slot's width."""
    kind = family_for(cfg).row_kind(cfg)
    if kind == "v4":  # one row per token and layer (common/model/deepseek/dsv4_config.py)
        assert cfg.v4 is not None
        if kv_cache_dtype in (None, dtype):
            return cfg.v4.row_width(cfg.head_dim), 1, dtype
        if kv_cache_dtype != FP8_DTYPE:
            raise ValueError(f"a DeepSeek-V4 cache stores {dtype} or fp8, not {kv_cache_dtype}")
        return v4_fp8_row_bytes(cfg, dtype), 1, "uint8"
    if kind == "kv":
        return cfg.head_dim, 2, kv_cache_dtype or dtype
    fmt = latent_format(cfg, dtype, kv_cache_dtype)
    return fmt.elements, 1, fmt.storage_dtype


def v4_fp8_row_bytes(cfg: ModelConfig, dtype: str) -> int:
    """Bytes of a DeepSeek-V4 cache slot with --kv-cache-dtype fp8 (kernels/fp8_ds_v4.py's
    rows, arithmetic only: the router imports no torch): the wider of a per-token row (the
    K=V row in vLLM's fp8 form, then the compressors' projections in ``dtype``) and an
    entry (the K=V record, then CSA's indexer key in fp8 with its float32 scale)."""
    v4 = cfg.v4
    assert v4 is not None
    head_dim, rope = cfg.head_dim, v4.rope_dim
    nope = head_dim - rope
    if nope < V4_TILE or nope % V4_TILE:
        raise ValueError(
            f"the fp8 DeepSeek-V4 row needs head_dim - rope_dim to be a multiple of "
            f"{V4_TILE}, the model's is {head_dim} - {rope} = {nope}"
        )
    kv = nope + 2 * rope + nope // V4_TILE + 1  # 584 in V4-Flash: 448 + 128 + 7 + a pad
    rows = kv + (v4.row_width(head_dim) - head_dim) * DTYPE_SIZES[dtype]
    entries = kv
    if CSA in v4.layer_kinds:
        index = v4.index_head_dim
        if index % INDEX_TILE:
            raise ValueError(
                f"the fp8 indexer key needs index_head_dim to be a multiple of "
                f"{INDEX_TILE}, the model's is {index}"
            )
        entries += index + 4 * (index // INDEX_TILE)
    return max(rows, entries)
