"""DeepSeek-V4's paged ops, the implementation chosen per call as kernels/__init__.py
chooses (CUDA tensors: the Triton kernels of kernels/triton_v4.py; anything else, or
``PDSERVE_KERNELS=torch``: the batched torch reference of kernels/v4_reference.py, whose
signatures and semantics these are).

A case the Triton kernel does not take (named by ``triton_v4.unsupported``: e.g. a head
dim that is not a power of two) runs the torch reference on the same device, which is
correct but host-synchronising (no CUDA graph can capture it); ``unsupported_reason``
tells a caller why, so it can refuse graphs by name.
"""

from __future__ import annotations

import functools
from types import ModuleType

import torch

from pdserve.kernels import backend_name, v4_reference
from pdserve.kernels.v4_reference import Fp8Rows

__all__ = ["Fp8Rows", "compress", "sink_attention", "unsupported_reason", "write_rows"]


@functools.cache
def _triton() -> ModuleType:
    from pdserve.kernels import triton_v4

    return triton_v4


def _triton_for(op: str, *tensors: torch.Tensor, **facts: object) -> ModuleType | None:
    if backend_name(tensors[0].device) != "triton":
        return None
    mod = _triton()
    return None if mod.unsupported(op, *tensors, **facts) else mod


def unsupported_reason(op: str, *tensors: torch.Tensor, **facts: object) -> str | None:
    """Why ``op`` would not run as a Triton kernel on these arguments (None: it would, or
    the device takes the reference anyway)."""
    if backend_name(tensors[0].device) != "triton":
        return None
    reason: str | None = _triton().unsupported(op, *tensors, **facts)
    return reason


def write_rows(cache: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor) -> None:
    impl = _triton_for("write_rows", cache, rows) or v4_reference
    impl.write_rows(cache, rows, slots)


def compress(
    cache: torch.Tensor,
    slots: torch.Tensor,
    offset: int,
    ape: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    overlap: bool,
    dtype: torch.dtype,
    fp8: Fp8Rows | None = None,
) -> torch.Tensor:
    impl = _triton_for("compress", cache, ape, weight, fp8=fp8) or v4_reference
    out: torch.Tensor = impl.compress(cache, slots, offset, ape, weight, eps, overlap, dtype, fp8)
    return out


def sink_attention(
    q: torch.Tensor,
    rows_cache: torch.Tensor,
    window_slots: torch.Tensor,
    entries_cache: torch.Tensor | None,
    entry_slots: torch.Tensor | None,
    sinks: torch.Tensor,
    scale: float,
    fp8: Fp8Rows | None = None,
) -> torch.Tensor:
    impl = _triton_for("sink_attention", q, rows_cache, fp8=fp8) or v4_reference
    out: torch.Tensor = impl.sink_attention(
        q, rows_cache, window_slots, entries_cache, entry_slots, sinks, scale, fp8
    )
    return out
