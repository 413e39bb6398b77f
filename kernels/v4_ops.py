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

__all__ = [
    "Fp8Rows",
    "compress",
    "norm_rope",
    "sink_attention",
    "slots_of",
    "unsupported_reason",
    "write_parts",
    "write_rows",
]


@functools.cache
def _triton() -> ModuleType:
    from pdserve.kernels import triton_v4

    return triton_v4


@functools.cache
def _triton_decode() -> ModuleType:
    from pdserve.kernels import triton_v4_decode

    return triton_v4_decode


_DECODE_OPS = ("norm_rope", "write_parts", "slots_of")


def _triton_for(op: str, *tensors: torch.Tensor, **facts: object) -> ModuleType | None:
    if backend_name(tensors[0].device) != "triton":
        return None
    mod = _triton_decode() if op in _DECODE_OPS else _triton()
    return None if mod.unsupported(op, *tensors, **facts) else mod


def unsupported_reason(op: str, *tensors: torch.Tensor, **facts: object) -> str | None:
    """Why ``op`` would not run as a Triton kernel on these arguments (None: it would, or
    the device takes the reference anyway)."""
    if backend_name(tensors[0].device) != "triton":
        return None
    mod = _triton_decode() if op in _DECODE_OPS else _triton()
    reason: str | None = mod.unsupported(op, *tensors, **facts)
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
    cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None,  # [P, R / 2]: rotate (rope_ref)
) -> torch.Tensor:
    """Each closing window's entry (v4_reference.compress), then, given ``cos_sin``, its
    trailing 2 * R / 2 values rotated as ``rope_ref`` (on CUDA inside the kernel)."""
    impl = _triton_for("compress", cache, ape, weight, fp8=fp8)
    if impl is not None:
        fused: torch.Tensor = impl.compress(
            cache, slots, offset, ape, weight, eps, overlap, dtype, fp8, cos_sin
        )
        return fused
    out: torch.Tensor = v4_reference.compress(
        cache, slots, offset, ape, weight, eps, overlap, dtype, fp8
    )
    return out if cos_sin is None else norm_rope(out, None, None, *cos_sin)


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


# -- the attention's small ops: norms, rope, a row's pieces, slots --------------------------------
# (the torch code below is the CPU path, op for op as transformers' DeepSeek-V4 classes; on
# CUDA each call is one launch of kernels/triton_v4_decode.py)


def rms_ref(x: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' DeepseekV4UnweightedRMSNorm."""
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' DeepseekV4RMSNorm (in float32, weight applied before the cast back)."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (weight * h).to(x.dtype)


def rope_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x`` [T, ..., D] with its last 2 * cos.shape[-1] values rotated at each row's
    position (cos/sin [T, rope / 2]), as transformers' apply_rotary_pos_emb."""
    cos = cos.repeat_interleave(2, dim=-1)
    sin = sin.repeat_interleave(2, dim=-1)
    for _ in range(x.dim() - 2):
        cos, sin = cos[:, None], sin[:, None]
    dim = cos.shape[-1]
    nope, rope = x[..., :-dim], x[..., -dim:]
    pairs = torch.stack((-rope[..., 1::2], rope[..., 0::2]), dim=-1).flatten(-2)
    rotated = (rope.float() * cos + pairs.float() * sin).to(x.dtype)
    return torch.cat((nope, rotated), dim=-1)


def norm_rope(
    x: torch.Tensor,  # [T, H, D] or [T, D]
    weight: torch.Tensor | None,  # the weighted RMSNorm's; None: unweighted (given eps)
    eps: float | None,  # None: no norm
    cos: torch.Tensor | None = None,  # [T, R / 2] of each row's position; None: no rope
    sin: torch.Tensor | None = None,
    inverse: bool = False,  # the rotation undone (sin negated)
) -> torch.Tensor:
    """An optional RMSNorm over the last dim (V4's weighted or unweighted), then V4's
    interleaved rope over the trailing 2 * cos.shape[-1] values."""
    impl = _triton_for("norm_rope", x)
    if impl is not None:
        out: torch.Tensor = impl.norm_rope(x, weight, eps, cos, sin, inverse)
        return out
    if eps is not None:
        x = rms_ref(x, eps) if weight is None else rms_norm_ref(x, weight, eps)
    if cos is not None and sin is not None:
        x = rope_ref(x, cos, -sin if inverse else sin)
    return x


def write_parts(cache: torch.Tensor, parts: list[torch.Tensor], slots: torch.Tensor) -> None:
    """Each token's row, the concatenation of ``parts`` ([T, w_i] each) zero-padded to the
    cache's row and cast to its dtype, written into its slot (negative: skipped)."""
    impl = _triton_for("write_parts", cache, *parts)
    if impl is not None:
        impl.write_parts(cache, parts, slots)
        return
    row = torch.cat(parts, dim=-1)
    row = torch.nn.functional.pad(row, (0, cache.shape[-1] - row.shape[-1])).to(cache.dtype)
    write_rows(cache, row, slots)


def slots_of_ref(
    tables: torch.Tensor,  # [T, max_blocks] int64: each row's block table
    pos: torch.Tensor,  # [T, K] int64 positions; negative: none
    size: int,  # block size
) -> torch.Tensor:  # [T, K] int64 slots, -1 where there is none
    width = tables.shape[1]
    if width == 0:
        return torch.full_like(pos, -1)
    p = pos.clamp_min(0)
    blocks = tables.gather(1, (p // size).clamp_max(width - 1))
    ok = (pos >= 0) & (pos // size < width) & (blocks >= 0)
    return torch.where(ok, blocks * size + p % size, -1)


def slots_of(
    tables: torch.Tensor,  # [R, max_blocks]: block tables
    pos: torch.Tensor,  # [T, K] positions; negative: none
    size: int,  # block size
    rows: torch.Tensor | None = None,  # [T]: each row's table (None: row t is table t)
) -> torch.Tensor:  # [T, K] int64 slots, -1 where there is none
    """Slots of positions through per-row block tables (no host sync)."""
    impl = _triton_for("slots_of", pos)
    if impl is not None:
        out: torch.Tensor = impl.slots_of(tables, pos, size, rows)
        return out
    if rows is not None:
        tables = tables[rows]
    return slots_of_ref(tables.long(), pos.long(), size)
