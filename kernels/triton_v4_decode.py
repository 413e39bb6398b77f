"""DeepSeek-V4 attention's small per-step ops as one Triton launch each (chosen per call by
kernels/v4_ops.py, whose torch code is their reference and the CPU path): a decode step's
graph is bound by its node count, so what was ~10 torch ops becomes one kernel.

* ``norm_rope``: per row of ``[T, H, D]`` (or ``[T, D]``), an optional RMSNorm (V4's
  unweighted one, ``x * rsqrt(mean(x.float()^2) + eps).to(x.dtype)``, or its weighted one in
  float32, the weight applied before the cast back), then V4's interleaved rope over the
  trailing ``R`` values at the row's token's cos/sin (sin negated: the inverse rotation).
  ``R = 0``: the norm alone. One program a row; a rope value's partner (``d ^ 1``) is loaded
  and normed alongside, so no value moves between lanes.
* ``write_parts``: a token's cache row put together from up to ``MAX_PARTS`` column pieces
  (the concatenation), cast to the cache dtype, zero-padded to the row's width and written
  into its slot (negative: skipped), in one pass.
* ``slots_of``: the cache slots of positions through per-row block tables (``rows``
  picking each query's table row), -1 where there is none.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_PARTS = 6
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def unsupported(op: str, *tensors: torch.Tensor) -> str | None:
    """Why ``op`` cannot run as a Triton kernel on these arguments; None if it can."""
    if op == "norm_rope":
        (x,) = tensors
        if x.dtype not in _DTYPES:
            return f"norm_rope: values of {x.dtype}"
        return None
    if op == "write_parts":
        if len(tensors) - 1 > MAX_PARTS:
            return f"write_parts: {len(tensors) - 1} parts (at most {MAX_PARTS})"
        return None
    if op == "slots_of":
        return None
    return f"{op}: no Triton kernel"


# -- norm + rope ---------------------------------------------------------------------------


@triton.jit
def _normed(x, w, r, NORM: tl.constexpr):
    # x in its dtype, w float32, r the row's float32 rsqrt: the row's normed values
    if NORM == 1:  # unweighted: the factor cast to x's dtype, the product rounded to it
        # (in float32: a product of two 16-bit floats is exact there, rounded once)
        return (x.to(tl.float32) * r.to(x.dtype).to(tl.float32)).to(x.dtype)
    elif NORM == 2:  # weighted: in float32, the weight applied before the cast back
        return (w * (x.to(tl.float32) * r)).to(x.dtype)
    else:
        return x


@triton.jit
def _norm_rope_kernel(
    x_ptr, w_ptr, cos_ptr, sin_ptr, out_ptr,
    H, D, R, x_st, x_sh, o_st, o_sh, cs_st, eps,
    NORM: tl.constexpr, ROPE: tl.constexpr, INVERSE: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    t = row // H
    h = row % H
    d = tl.arange(0, BLOCK_D)
    mask = d < D
    src = x_ptr + t * x_st + h * x_sh
    x = tl.load(src + d, mask=mask, other=0.0)
    r = 0.0
    if NORM != 0:
        xf = x.to(tl.float32)
        r = 1.0 / tl.sqrt(tl.sum(xf * xf, 0) / D + eps)
    w = tl.full([BLOCK_D], 1.0, tl.float32)
    if NORM == 2:
        w = tl.load(w_ptr + d, mask=mask, other=0.0).to(tl.float32)
    y = _normed(x, w, r, NORM)
    if ROPE:
        first = D - R
        is_rope = mask & (d >= first)
        partner = d ^ 1  # first is even: pairs (2i, 2i + 1) of the rope part
        px = tl.load(src + partner, mask=is_rope, other=0.0)
        pw = tl.full([BLOCK_D], 1.0, tl.float32)
        if NORM == 2:
            pw = tl.load(w_ptr + partner, mask=is_rope, other=0.0).to(tl.float32)
        py = _normed(px, pw, r, NORM).to(tl.float32)
        rel = tl.where(is_rope, d - first, 0)
        c = tl.load(cos_ptr + t * cs_st + rel // 2, mask=is_rope, other=0.0).to(tl.float32)
        s = tl.load(sin_ptr + t * cs_st + rel // 2, mask=is_rope, other=0.0).to(tl.float32)
        if INVERSE:
            s = -s
        # transformers' rotate: even 2i gets -x[2i + 1], odd 2i + 1 gets x[2i]
        pair = tl.where((rel % 2) == 1, py, -py)
        rot = y.to(tl.float32) * c + pair * s
        y = tl.where(is_rope, rot.to(y.dtype), y)
    tl.store(out_ptr + t * o_st + h * o_sh + d, y, mask=mask)


def norm_rope(
    x: torch.Tensor,  # [T, H, D] or [T, D]
    weight: torch.Tensor | None,  # [D]: the weighted norm; None: unweighted (if eps)
    eps: float | None,  # None: no norm
    cos: torch.Tensor | None,  # [T, R / 2]; None: no rope
    sin: torch.Tensor | None,
    inverse: bool = False,
) -> torch.Tensor:
    shape = x.shape
    d = shape[-1]
    x3 = x.reshape(shape[0], -1, d) if x.dim() != 3 else x
    if x3.stride(-1) != 1:
        x3 = x3.contiguous()
    num, heads = x3.shape[0], x3.shape[1]
    out = torch.empty(num, heads, d, dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out.view(shape)
    norm = 0 if eps is None else (1 if weight is None else 2)
    rope = cos is not None and sin is not None and cos.shape[-1] > 0
    r = 2 * cos.shape[-1] if rope else 0  # type: ignore[union-attr]
    cs = cos.contiguous() if rope else x3  # type: ignore[union-attr]
    sn = sin.contiguous() if rope else x3  # type: ignore[union-attr]
    _norm_rope_kernel[(num * heads,)](
        x3, weight if weight is not None else x3, cs, sn, out,
        heads, d, r, x3.stride(0), x3.stride(1), out.stride(0), out.stride(1),
        cs.stride(0) if rope else 0, float(eps or 0.0),
        NORM=norm, ROPE=rope, INVERSE=inverse, BLOCK_D=triton.next_power_of_2(d),
    )  # fmt: skip
    return out.view(shape)


# -- a row from pieces, into its slot ----------------------------------------------------------


@triton.jit
def _put(dst, src, width, BLOCK: tl.constexpr):
    for c0 in range(0, width, BLOCK):
        cols = c0 + tl.arange(0, BLOCK)
        m = cols < width
        v = tl.load(src + cols, mask=m)
        tl.store(dst + cols, v.to(dst.dtype.element_ty), mask=m)


@triton.jit
def _write_parts_kernel(
    cache_ptr, slots_ptr, sl_st, c_sb, c_so, B, row_width,
    p0, s0, w0, p1, s1, w1, p2, s2, w2, p3, s3, w3, p4, s4, w4, p5, s5, w5,
    BLOCK: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0)
    slot = tl.load(slots_ptr + t * sl_st).to(tl.int64)
    if slot >= 0:
        dst = cache_ptr + (slot // B) * c_sb + (slot % B) * c_so
        _put(dst, p0 + t * s0, w0, BLOCK)
        at = w0
        _put(dst + at, p1 + t * s1, w1, BLOCK)
        at += w1
        _put(dst + at, p2 + t * s2, w2, BLOCK)
        at += w2
        _put(dst + at, p3 + t * s3, w3, BLOCK)
        at += w3
        _put(dst + at, p4 + t * s4, w4, BLOCK)
        at += w4
        _put(dst + at, p5 + t * s5, w5, BLOCK)
        at += w5
        for c0 in range(at, row_width, BLOCK):  # the padding
            cols = c0 + tl.arange(0, BLOCK)
            zero = tl.zeros([BLOCK], tl.float32).to(cache_ptr.dtype.element_ty)
            tl.store(dst + cols, zero, mask=cols < row_width)


def write_parts(cache: torch.Tensor, parts: list[torch.Tensor], slots: torch.Tensor) -> None:
    num = slots.shape[0]
    if num == 0:
        return
    assert cache.stride(-1) == 1 and len(parts) <= MAX_PARTS
    args: list[object] = []
    for p in parts:
        p = p.reshape(num, -1)
        if p.stride(-1) != 1:
            p = p.contiguous()
        args += [p, p.stride(0), p.shape[1]]
    for _ in range(MAX_PARTS - len(parts)):
        args += [cache, 0, 0]
    row = cache.shape[-1]
    _write_parts_kernel[(num,)](
        cache, slots, slots.stride(0), cache.stride(0), cache.stride(3), cache.shape[3], row,
        *args,
        BLOCK=min(512, triton.next_power_of_2(max(row, 16))),
    )  # fmt: skip


# -- slots of positions ------------------------------------------------------------------------


@triton.jit
def _slots_of_kernel(
    tables_ptr, rows_ptr, pos_ptr, out_ptr, t_st, r_st, p_st, o_st, K, width, size,
    ROWS: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0)
    row = t
    if ROWS:
        row = tl.load(rows_ptr + t * r_st).to(tl.int64)
    for k0 in range(0, K, BLOCK):
        k = k0 + tl.arange(0, BLOCK)
        km = k < K
        pos = tl.load(pos_ptr + t * p_st + k, mask=km, other=-1).to(tl.int64)
        blk_i = tl.maximum(pos, 0) // size
        ok = km & (pos >= 0) & (blk_i < width)
        blk = tl.load(tables_ptr + row * t_st + blk_i, mask=ok, other=-1).to(tl.int64)
        slot = tl.where(ok & (blk >= 0), blk * size + tl.maximum(pos, 0) % size, -1)
        tl.store(out_ptr + t * o_st + k, slot, mask=km)


def slots_of(
    tables: torch.Tensor, pos: torch.Tensor, size: int, rows: torch.Tensor | None = None
) -> torch.Tensor:
    num, k = pos.shape
    out = torch.empty(num, k, dtype=torch.long, device=pos.device)
    if out.numel() == 0:
        return out
    if tables.shape[1] == 0:
        return out.fill_(-1)
    if tables.stride(-1) != 1:
        tables = tables.contiguous()
    if pos.stride(-1) != 1:
        pos = pos.contiguous()
    _slots_of_kernel[(num,)](
        tables, rows if rows is not None else pos, pos, out, tables.stride(0),
        rows.stride(0) if rows is not None else 0, pos.stride(0), out.stride(0), k,
        tables.shape[1], size,
        ROWS=rows is not None, BLOCK=min(1024, triton.next_power_of_2(max(k, 16))),
    )  # fmt: skip
    return out
