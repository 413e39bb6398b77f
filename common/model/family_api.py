"""The one interface between the engine and a model: what it asks of a model family
(``ModelFamily``: a module of common/model/families/, the answers it does not give taken
from the defaults here) and of the model the family builds (``ServingModel``).

The engine branches on none of a config's kinds (``v4``, MLA, an indexer): it asks the
family of ``cfg.architecture`` (``family_for``) for

- ``cache_kinds``: the KV cache's kinds of groups, (layers, sliding window, tokens a slot)
  each (common/engine/kv_groups.py cuts them into pages);
- ``row_kind``: what a cache slot holds, one of ``ROW_KINDS`` (common/engine/
  latent_format.py ``cache_head`` sizes it: the one definition of a row);
- ``attention_dims``: the q/k and v head widths attention runs at (benchmark floors);
- ``unsupported_ops``: the ops its kernels lack on a device, by name, with why (the
  loader refuses the model naming them; a family lists none once its kernels run there);
- ``shard_state``: a TP rank's cut of the checkpoint's tensors;
- ``own_dspark``: whether ``--speculative-config`` dspark reads the checkpoint's own DSpark
  module (DeepSeek-V4) rather than a separate DeepSpec directory.

Torch-free (the router reads configs): the defaults import torch only when called.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import ModuleType
from typing import TYPE_CHECKING, Any, Protocol

from pdserve.common.model.checkpoint.config import ModelConfig
from pdserve.common.model.registry import family_named

if TYPE_CHECKING:
    import torch

    from pdserve.common.model.decoder import CausalLM
    from pdserve.common.model.layers.attention import AttentionMetadata
    from pdserve.common.parallel.context import ParallelContext

# (layers, sliding window or None, tokens per slot) of one kind of KV cache group
CacheKind = tuple[tuple[int, ...], int | None, int]
# a slot's contents: K and V heads; an MLA latent (+ rope, + V3.2's indexer key); V4's row
ROW_KINDS = ("kv", "latent", "v4")


class ServingModel(Protocol):
    """What the engine (runner, loader, CUDA graphs, speculators) calls on a built model
    (``CausalLM``, ``DeepseekV4Model``), besides being a torch module."""

    kv_slots: list[tuple[int, int]]  # each layer's (cache group, slot in the block)
    keep_hidden: bool  # spec decode: keep the hidden states of the logits rows
    hidden: torch.Tensor | None

    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        logits_indices: torch.Tensor,
    ) -> torch.Tensor: ...

    def place_kv(self, groups: Sequence[tuple[Sequence[int], int]]) -> None: ...

    def decode_splits(self, num_seqs: int, num_kv_heads: int, device: torch.device) -> int: ...

    def pack_weights(self, prepack: bool = False) -> None: ...


class ModelFamily(Protocol):
    """A family's answers to the engine (module docstring)."""

    def read_config(self, raw: dict[str, Any]) -> ModelConfig: ...

    def build_model(self, cfg: ModelConfig, parallel: ParallelContext | None) -> CausalLM: ...

    def cache_kinds(self, cfg: ModelConfig) -> list[CacheKind]: ...

    def row_kind(self, cfg: ModelConfig) -> str: ...

    def attention_dims(self, cfg: ModelConfig) -> tuple[int, int]: ...

    def unsupported_ops(self, cfg: ModelConfig, device_type: str) -> dict[str, str]: ...

    def shard_state(
        self, state: dict[str, torch.Tensor], cfg: ModelConfig, tp_size: int, tp_rank: int
    ) -> dict[str, torch.Tensor]: ...

    @property
    def own_dspark(self) -> bool: ...


# -- the defaults: a decoder of common/model/decoder.py's shared layers ---------------------


def cache_kinds(cfg: ModelConfig) -> list[CacheKind]:
    """The layers grouped by sliding window (None: full attention), in order of first
    layer, one token a slot."""
    layers: dict[int | None, list[int]] = {}
    for i, window in enumerate(cfg.layer_windows):
        layers.setdefault(window, []).append(i)
    return [(tuple(ls), w, 1) for w, ls in layers.items()]


def row_kind(cfg: ModelConfig) -> str:
    return "latent" if cfg.kv_lora_rank > 0 else "kv"


def attention_dims(cfg: ModelConfig) -> tuple[int, int]:
    """(q/k head, v head) of QK^T and PV (MLA prefill expands the latent to these)."""
    if cfg.kv_lora_rank > 0:
        return cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, cfg.v_head_dim
    return cfg.head_dim, cfg.head_dim


def unsupported_ops(cfg: ModelConfig, device_type: str) -> dict[str, str]:
    return {}


def shard_state(
    state: dict[str, torch.Tensor], cfg: ModelConfig, tp_size: int, tp_rank: int
) -> dict[str, torch.Tensor]:
    from pdserve.common.model.decoder import shard_state_dict

    return shard_state_dict(state, cfg, tp_size, tp_rank)


def mla_unsupported(cfg: ModelConfig, device_type: str) -> dict[str, str]:
    """MLA's ops on ``device_type``: on CUDA the Triton MLA decode tiles the latent and its
    rope part in powers of two of 16 or more."""
    if device_type != "cuda":
        return {}
    from pdserve.kernels.triton_mla import untileable_sizes  # CUDA machines have Triton

    bad = untileable_sizes(cfg.kv_lora_rank, cfg.qk_rope_head_dim)
    if not bad:
        return {}
    return {
        "mla_decode_attention": "the CUDA MLA kernel needs kv_lora_rank and qk_rope_head_dim "
        f"to be powers of two >= 16; this model has "
        f"{', '.join(f'{k} {v}' for k, v in bad.items())}"
    }


_DEFAULTS = {
    "cache_kinds": cache_kinds,
    "row_kind": row_kind,
    "attention_dims": attention_dims,
    "unsupported_ops": unsupported_ops,
    "shard_state": shard_state,
}


class _Answers:
    """A family module's answers, the defaults where it gives none."""

    def __init__(self, module: ModuleType) -> None:
        self.module = module
        self.read_config = module.read_config
        self.build_model = module.build_model
        for name, default in _DEFAULTS.items():
            setattr(self, name, getattr(module, name, default))
        self.own_dspark: bool = getattr(module, "OWN_DSPARK", False)


def family_for(cfg: ModelConfig) -> ModelFamily:
    """The answers of ``cfg``'s family (common/model/registry.py)."""
    answers: ModelFamily = _Answers(family_named(cfg.architecture).load())  # type: ignore[assignment]
    return answers
