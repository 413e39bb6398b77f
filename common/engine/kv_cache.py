"""The KV cache tensor of one rank: allocated in its layout's storage order (engine/kv_layout.py),
seen by the model and the kernels as the logical view [N, L, 2, H_kv, B, D]."""

from __future__ import annotations

import torch

from pdserve.common.engine.kv_layout import KVLayout


def new_cache(layout: KVLayout, device: torch.device | str = "cpu") -> torch.Tensor:
    """A zeroed cache in our memory order, returned as its logical view [N, L, 2, H, B, D]."""
    storage = torch.zeros(layout.storage_shape, dtype=getattr(torch, layout.dtype), device=device)
    return storage.permute(layout.logical_from_storage)


def storage_of(kv_cache: torch.Tensor, layout: KVLayout) -> torch.Tensor:
    """The memory-order tensor ([H, N, ...] or [N, H, ...]) behind a logical cache view."""
    return kv_cache.permute(layout.storage_from_logical)
