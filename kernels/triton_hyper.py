"""DeepSeek-V4's hyper-connection glue in one Triton kernel per call (the torch reference,
op for op as transformers: kernels/hyper_ref.py).

The reference is ~25 launches plus 4 per Sinkhorn iteration (20 by default: ~100 a call,
two calls a layer); here one program per token reads its streams row once for the RMS
factor and the projection through ``fn`` (the factor applied to the projected values: the
same sum, rounded in another order, float32), computes pre, post and the n x n ``comb``
with its Sinkhorn iterations in registers, and reads the row again (from L2) for the
collapsed input. ``HEAD``: the model head's collapse (``pre`` alone).

:func:`step` folds a layer's glue around it (#47), so that a V4 layer's residual path is
two launches, not ~30:

* ``prev`` (the previous block's ``post``, ``comb`` and output ``out``): the streams are
  first combined, ``post * out + comb^T @ streams``, with the reference's roundings in the
  streams' dtype (``post`` and ``comb`` cast, the product, the n-term matmul and the sum
  each rounded; only the matmul's float32 summation order may differ), and written out
  (``store``) for the next combine;
* ``norm`` (the block's RMSNorm weight and eps): the collapsed input, rounded to the
  streams' dtype, RMS-normalised and weighted as dsv4_attention's ``RMSNorm`` does, so the
  block gets its normed input straight from the kernel;
* ``rows`` (the head): program t reads token ``rows[t]`` (the logits rows), so the last
  layer's combine, ``hc_head`` and the final norm are one launch over the rows kept.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.kernels.triton_common import _device_guard


@triton.jit
def _round(x, ROUND: tl.constexpr):
    """float32 ``x`` rounded to the streams' dtype (0 float32, 1 bfloat16, 2 float16), to
    nearest even, in float32; bfloat16 by its bits, which Triton's interpreter would
    otherwise truncate (the GPU's cast rounds to nearest even: the same values)."""
    if ROUND == 1:
        b = x.to(tl.uint32, bitcast=True)
        b = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16) << 16
        return b.to(tl.float32, bitcast=True)
    elif ROUND == 2:
        return x.to(tl.float16).to(tl.float32)
    else:
        return x


@triton.jit
def _chunk(
    row_ptr,  # the token's streams [N, H]
    out_row_ptr,  # PREV: the block output [H] of the token
    post_b,  # PREV: [N] post, rounded to the streams' dtype
    comb_b,  # PREV: [N, N] comb (row j, column i), rounded to the streams' dtype
    hh,
    h_ok,
    H,
    N: tl.constexpr,
    PREV: tl.constexpr,
    ROUND: tl.constexpr,
):
    """The token's streams over columns ``hh`` [N, BLOCK_H] in float32 (values of the
    streams' dtype): as stored, or combined from the previous block's output."""
    i = tl.arange(0, N)
    x = tl.load(row_ptr + i[:, None] * H + hh[None, :], mask=h_ok[None, :], other=0.0)
    x = x.to(tl.float32)
    if PREV:
        o = tl.load(out_row_ptr + hh, mask=h_ok, other=0.0).to(tl.float32)
        prod = _round(post_b[:, None] * o[None, :], ROUND)
        # comb^T @ streams: new[i] = sum_j comb[j, i] * streams[j]
        mm = _round(tl.sum(comb_b[:, :, None] * x[:, None, :], axis=0), ROUND)
        x = _round(prod + mm, ROUND)
    return x


@triton.jit
def _weights(
    proj,  # [BLOCK_M] the projected row, RMS factor applied
    base_ptr,
    scale_ptr,
    post_row,  # [N] out (not HEAD; STORE)
    comb_row,  # [N, N] out (not HEAD; STORE)
    hc_eps,
    N: tl.constexpr,
    ITERS: tl.constexpr,
    HEAD: tl.constexpr,
    STORE,  # whether this program writes post and comb
    BLOCK_M: tl.constexpr,
):
    """pre [N] (returned), post and the Sinkhorn-normalised comb (stored) of a row."""
    rows = tl.arange(0, BLOCK_M)
    i = tl.arange(0, N)
    # pre: rows [0, N)
    pre_w = tl.sum(tl.where(rows[None, :] == i[:, None], proj[None, :], 0.0), axis=1)  # [N]
    pre_s = tl.load(scale_ptr).to(tl.float32)
    pre = tl.sigmoid(pre_w * pre_s + tl.load(base_ptr + i).to(tl.float32)) + hc_eps
    if not HEAD:
        post_w = tl.sum(tl.where(rows[None, :] == (N + i)[:, None], proj[None, :], 0.0), axis=1)
        post_bias = tl.load(base_ptr + N + i).to(tl.float32)
        post = 2.0 * tl.sigmoid(post_w * tl.load(scale_ptr + 1).to(tl.float32) + post_bias)
        # comb [N, N]: row a, column b is proj[2N + a * N + b]
        ab = 2 * N + i[:, None] * N + i[None, :]  # [N, N]
        sel = rows[None, None, :] == ab[:, :, None]  # [N, N, BLOCK_M]
        comb_w = tl.sum(tl.where(sel, proj[None, None, :], 0.0), axis=2)
        logits = comb_w * tl.load(scale_ptr + 2).to(tl.float32)
        logits = logits + tl.load(base_ptr + ab).to(tl.float32)
        logits = logits - tl.max(logits, axis=1)[:, None]
        e = tl.exp(logits)
        comb = e / tl.sum(e, axis=1)[:, None] + hc_eps
        comb = comb / (tl.sum(comb, axis=0)[None, :] + hc_eps)
        for _ in range(ITERS - 1):
            comb = comb / (tl.sum(comb, axis=1)[:, None] + hc_eps)
            comb = comb / (tl.sum(comb, axis=0)[None, :] + hc_eps)
        if STORE:
            tl.store(post_row + i, post)
            tl.store(comb_row + i[:, None] * N + i[None, :], comb)
    return pre


@triton.jit
def _hyper_kernel(
    streams_ptr,  # [*, N, H] rows of stride stride_t, innermost contiguous
    rows_ptr,  # [T] int: the row program t reads (ROWS)
    prev_post_ptr,  # [*, N] fp32 (PREV)
    prev_comb_ptr,  # [*, N, N] fp32 (PREV)
    prev_out_ptr,  # [*, H] rows of stride stride_o (PREV)
    fn_ptr,  # [M, N * H]: M = (2 + N) * N, or N (HEAD)
    base_ptr,  # [M]
    scale_ptr,  # [3], or [1] (HEAD)
    norm_ptr,  # [H] the block's RMSNorm weight (NORM)
    new_ptr,  # [T, N, H] the combined streams (STORE)
    post_ptr,  # [T, N] fp32 (not HEAD)
    comb_ptr,  # [T, N, N] fp32 (not HEAD)
    out_ptr,  # [T, H] in the streams' dtype
    H,
    stride_t,
    stride_o,
    stride_fm,
    eps,
    hc_eps,
    norm_eps,
    N: tl.constexpr,
    ITERS: tl.constexpr,  # Sinkhorn iterations
    HEAD: tl.constexpr,
    PREV: tl.constexpr,
    STORE: tl.constexpr,
    ROWS: tl.constexpr,
    NORM: tl.constexpr,
    ROUND: tl.constexpr,  # the streams' dtype: 0 float32, 1 bfloat16, 2 float16
    BLOCK_M: tl.constexpr,  # M padded to a power of two
    BLOCK_H: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    r = tl.load(rows_ptr + t).to(tl.int64) if ROWS else t
    row = streams_ptr + r * stride_t
    out_row = prev_out_ptr + r * stride_o
    K = N * H
    M: tl.constexpr = N if HEAD else (2 + N) * N
    dt = streams_ptr.dtype.element_ty
    i = tl.arange(0, N)
    if PREV:
        post_b = _round(tl.load(prev_post_ptr + r * N + i), ROUND)
        comb_b = _round(tl.load(prev_comb_ptr + r * N * N + i[:, None] * N + i[None, :]), ROUND)
    else:
        post_b = tl.zeros([N], tl.float32)
        comb_b = tl.zeros([N, N], tl.float32)
    rows = tl.arange(0, BLOCK_M)
    r_ok = rows < M
    d = tl.arange(0, BLOCK_H)
    proj = tl.zeros([BLOCK_M], tl.float32)
    ss = tl.zeros([N], tl.float32)
    for h0 in range(0, H, BLOCK_H):
        hh = h0 + d
        h_ok = hh < H
        x = _chunk(row, out_row, post_b, comb_b, hh, h_ok, H, N, PREV, ROUND)  # [N, BLOCK_H]
        if STORE:
            tl.store(new_ptr + t * K + i[:, None] * H + hh[None, :], x.to(dt),
                     mask=h_ok[None, :])  # fmt: skip
        ss += tl.sum(x * x, axis=1)
        w = tl.load(
            fn_ptr + rows[:, None, None] * stride_fm + i[None, :, None] * H + hh[None, None, :],
            mask=r_ok[:, None, None] & h_ok[None, None, :],
            other=0.0,
        ).to(tl.float32)
        proj += tl.sum(tl.sum(w * x[None, :, :], axis=2), axis=1)
    proj = proj * tl.rsqrt(tl.sum(ss, axis=0) / K + eps)

    pre = _weights(proj, base_ptr, scale_ptr, post_ptr + t * N, comb_ptr + t * N * N, hc_eps,
                   N, ITERS, HEAD, True, BLOCK_M)  # fmt: skip

    # the block's input: sum_i pre_i * stream_i (the streams read, or combined, again: L2)
    o_row = out_ptr + t * H
    ss2 = tl.zeros([BLOCK_H], tl.float32)
    for h0 in range(0, H, BLOCK_H):
        hh = h0 + d
        h_ok = hh < H
        x = _chunk(row, out_row, post_b, comb_b, hh, h_ok, H, N, PREV, ROUND)
        y = _round(tl.sum(pre[:, None] * x, axis=0), ROUND)
        tl.store(o_row + hh, y.to(dt), mask=h_ok)
        if NORM:
            ss2 += y * y
    if NORM:
        # dsv4_attention's RMSNorm of the rounded input: x * rsqrt(mean(x^2) + eps), times
        # the weight, rounded; the row re-read after a barrier (other threads wrote it)
        inv = tl.rsqrt(tl.sum(ss2, axis=0) / H + norm_eps)
        tl.debug_barrier()
        for h0 in range(0, H, BLOCK_H):
            hh = h0 + d
            h_ok = hh < H
            y = tl.load(o_row + hh, mask=h_ok, other=0.0).to(tl.float32)
            wn = tl.load(norm_ptr + hh, mask=h_ok, other=0.0).to(tl.float32)
            tl.store(o_row + hh, _round(wn * (y * inv), ROUND).to(dt), mask=h_ok)


@triton.jit
def _split_partial_kernel(
    streams_ptr, rows_ptr, prev_post_ptr, prev_comb_ptr, prev_out_ptr, fn_ptr,
    new_ptr,  # [T, N, H] the combined streams (STORE)
    part_ptr,  # [T, S, BLOCK_M + N * N] fp32: per column slice, the projection and Gram
    H, stride_t, stride_o, stride_fm, S,
    N: tl.constexpr, HEAD: tl.constexpr, PREV: tl.constexpr, STORE: tl.constexpr,
    ROWS: tl.constexpr, ROUND: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr,
    SUB: tl.constexpr,  # BLOCK_H chunks a program: its slice is SUB * BLOCK_H columns
):  # fmt: skip
    """The split form's first launch, grid (token, column slice): the slice of the token's
    streams (combined, stored), its share of the projection through ``fn`` and of the
    streams' n x n Gram matrix (whose trace is the RMS's sum of squares, and pre^T G pre
    the collapsed input's)."""
    t = tl.program_id(0).to(tl.int64)
    sl = tl.program_id(1)
    r = tl.load(rows_ptr + t).to(tl.int64) if ROWS else t
    row = streams_ptr + r * stride_t
    out_row = prev_out_ptr + r * stride_o
    M: tl.constexpr = N if HEAD else (2 + N) * N
    dt = streams_ptr.dtype.element_ty
    i = tl.arange(0, N)
    if PREV:
        post_b = _round(tl.load(prev_post_ptr + r * N + i), ROUND)
        comb_b = _round(tl.load(prev_comb_ptr + r * N * N + i[:, None] * N + i[None, :]), ROUND)
    else:
        post_b = tl.zeros([N], tl.float32)
        comb_b = tl.zeros([N, N], tl.float32)
    rows = tl.arange(0, BLOCK_M)
    r_ok = rows < M
    d = tl.arange(0, BLOCK_H)
    proj = tl.zeros([BLOCK_M], tl.float32)
    gram = tl.zeros([N, N], tl.float32)
    for c in range(SUB):
        hh = (sl * SUB + c) * BLOCK_H + d
        h_ok = hh < H
        x = _chunk(row, out_row, post_b, comb_b, hh, h_ok, H, N, PREV, ROUND)  # [N, BLOCK_H]
        if STORE:
            tl.store(new_ptr + t * N * H + i[:, None] * H + hh[None, :], x.to(dt),
                     mask=h_ok[None, :])  # fmt: skip
        gram += tl.sum(x[:, None, :] * x[None, :, :], axis=2)
        w = tl.load(
            fn_ptr + rows[:, None, None] * stride_fm + i[None, :, None] * H + hh[None, None, :],
            mask=r_ok[:, None, None] & h_ok[None, None, :],
            other=0.0,
        ).to(tl.float32)
        proj += tl.sum(tl.sum(w * x[None, :, :], axis=2), axis=1)
    part = part_ptr + (t * S + sl) * (BLOCK_M + N * N)
    tl.store(part + rows, proj)
    tl.store(part + BLOCK_M + i[:, None] * N + i[None, :], gram)


@triton.jit
def _split_finish_kernel(
    streams_ptr, rows_ptr, prev_post_ptr, prev_comb_ptr, prev_out_ptr, base_ptr, scale_ptr,
    norm_ptr, part_ptr, post_ptr, comb_ptr, out_ptr,
    H, stride_t, stride_o, S, eps, hc_eps, norm_eps,
    N: tl.constexpr, ITERS: tl.constexpr, HEAD: tl.constexpr, PREV: tl.constexpr,
    ROWS: tl.constexpr, NORM: tl.constexpr, ROUND: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_H: tl.constexpr, SUB: tl.constexpr, BLOCK_S: tl.constexpr,
):  # fmt: skip
    """The split form's second launch, grid (token, column slice): every program sums the
    token's partials (the RMS factor from the Gram's trace), computes pre / post / comb
    (slice 0 stores post and comb), and writes its slice of the collapsed input, normed
    with the whole row's sum of squares pre^T G pre (of the unrounded input: the
    reference's is of the rounded one, a float32-order difference)."""
    t = tl.program_id(0).to(tl.int64)
    sl = tl.program_id(1)
    r = tl.load(rows_ptr + t).to(tl.int64) if ROWS else t
    row = streams_ptr + r * stride_t
    out_row = prev_out_ptr + r * stride_o
    dt = streams_ptr.dtype.element_ty
    i = tl.arange(0, N)
    sp = tl.arange(0, BLOCK_S)
    s_ok = sp < S
    rows = tl.arange(0, BLOCK_M)
    part = part_ptr + (t * S + sp) * (BLOCK_M + N * N)  # [BLOCK_S]
    proj = tl.sum(tl.load(part[:, None] + rows[None, :], mask=s_ok[:, None], other=0.0), axis=0)
    gram = tl.sum(
        tl.load(part[:, None, None] + BLOCK_M + i[None, :, None] * N + i[None, None, :],
                mask=s_ok[:, None, None], other=0.0),
        axis=0,
    )  # fmt: skip
    diag = tl.where(i[:, None] == i[None, :], gram, 0.0)
    proj = proj * tl.rsqrt(tl.sum(tl.sum(diag, axis=1), axis=0) / (N * H) + eps)
    pre = _weights(proj, base_ptr, scale_ptr, post_ptr + t * N, comb_ptr + t * N * N, hc_eps,
                   N, ITERS, HEAD, sl == 0, BLOCK_M)  # fmt: skip
    if PREV:
        post_b = _round(tl.load(prev_post_ptr + r * N + i), ROUND)
        comb_b = _round(tl.load(prev_comb_ptr + r * N * N + i[:, None] * N + i[None, :]), ROUND)
    else:
        post_b = tl.zeros([N], tl.float32)
        comb_b = tl.zeros([N, N], tl.float32)
    inv = 1.0
    if NORM:
        sq = tl.sum(tl.sum(pre[:, None] * gram * pre[None, :], axis=1), axis=0)
        inv = tl.rsqrt(sq / H + norm_eps)
    d = tl.arange(0, BLOCK_H)
    for c in range(SUB):
        hh = (sl * SUB + c) * BLOCK_H + d
        h_ok = hh < H
        x = _chunk(row, out_row, post_b, comb_b, hh, h_ok, H, N, PREV, ROUND)
        y = _round(tl.sum(pre[:, None] * x, axis=0), ROUND)
        if NORM:
            wn = tl.load(norm_ptr + hh, mask=h_ok, other=0.0).to(tl.float32)
            y = _round(wn * (y * inv), ROUND)
        tl.store(out_ptr + t * H + hh, y.to(dt), mask=h_ok)


# The split form (two launches, every program a slice of the columns) below this many
# tokens: at decode sizes one program per token would read all of ``fn`` (24 x 4 x 4,096
# values at V4-Flash) alone, on one SM; from here the single launch has programs enough.
SPLIT_BELOW = 128
SPLIT_COLUMNS = 128  # a split program's slice of the hidden columns

_ROUND = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def step(
    streams: torch.Tensor,  # [T0, n, hidden]
    fn: torch.Tensor,  # [(2 + n) * n, n * hidden], or [n, n * hidden] (head)
    base: torch.Tensor,
    scale: torch.Tensor,
    eps: float,
    hc_eps: float,
    sinkhorn_iters: int,
    *,
    prev: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,  # post, comb, out
    norm: tuple[torch.Tensor, float] | None = None,  # the block's RMSNorm (weight, eps)
    head: bool = False,
    rows: torch.Tensor | None = None,  # [T] the rows to compute (default: all T0)
    store: bool = True,  # with prev: write the combined streams
    split: bool | None = None,  # the two-launch form (None: below SPLIT_BELOW tokens)
) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(combined streams [T, n, hidden] or None, post [T, n] fp32, comb [T, n, n] fp32,
    the block's (normed) input [T, hidden]); see the module's docstring. One launch, no
    host read: CUDA graphs capture it."""
    num_rows, n, hidden = streams.shape
    assert n & (n - 1) == 0, f"hc_mult must be a power of two, got {n}"
    if streams.stride(2) != 1 or streams.stride(1) != hidden:
        streams = streams.contiguous()
    num_tokens = num_rows if rows is None else rows.shape[0]
    m = n if head else (2 + n) * n
    assert fn.shape == (m, n * hidden) and fn.stride(1) == 1, tuple(fn.shape)
    dev = streams.device
    out = torch.empty((num_tokens, hidden), dtype=streams.dtype, device=dev)
    post = torch.empty((num_tokens, n), dtype=torch.float32, device=dev)
    comb = torch.empty((num_tokens, n, n), dtype=torch.float32, device=dev)
    new = None
    if prev is not None:
        p_post, p_comb, p_out = prev
        assert p_post.dtype == p_comb.dtype == torch.float32 and p_out.stride(1) == 1
        assert p_post.is_contiguous() and p_comb.is_contiguous()
        assert p_out.shape == (num_rows, hidden), (tuple(p_out.shape), num_rows, hidden)
        if store:
            new = torch.empty((num_tokens, n, hidden), dtype=streams.dtype, device=dev)
    if split is None:
        split = num_tokens < SPLIT_BELOW
    if num_tokens and split:
        block_m = triton.next_power_of_2(m)
        block_h = 32
        sub = max(1, min(SPLIT_COLUMNS, triton.next_power_of_2(hidden)) // block_h)
        slices = triton.cdiv(hidden, block_h * sub)
        part = torch.empty((num_tokens, slices, block_m + n * n), dtype=torch.float32, device=dev)
        flags = dict(N=n, HEAD=head, PREV=prev is not None, ROWS=rows is not None,
                     ROUND=_ROUND[streams.dtype], BLOCK_M=block_m, BLOCK_H=block_h, SUB=sub)  # fmt: skip
        row_ptr = streams if rows is None else rows
        p_post = post if prev is None else prev[0]
        p_comb = comb if prev is None else prev[1]
        p_out = out if prev is None else prev[2]
        stride_o = hidden if prev is None else prev[2].stride(0)
        with _device_guard(streams):
            _split_partial_kernel[(num_tokens, slices)](
                streams, row_ptr, p_post, p_comb, p_out, fn, out if new is None else new, part,
                hidden, streams.stride(0), stride_o, fn.stride(0), slices,
                STORE=new is not None, num_warps=4, **flags,
            )  # fmt: skip
            _split_finish_kernel[(num_tokens, slices)](
                streams, row_ptr, p_post, p_comb, p_out,
                base if base.is_contiguous() else base.contiguous(), scale,
                out if norm is None else norm[0], part, post, comb, out,
                hidden, streams.stride(0), stride_o, slices, eps, hc_eps,
                1e-6 if norm is None else norm[1],
                ITERS=sinkhorn_iters, NORM=norm is not None,
                BLOCK_S=triton.next_power_of_2(slices), num_warps=4, **flags,
            )  # fmt: skip
    elif num_tokens:
        with _device_guard(streams):
            _hyper_kernel[(num_tokens,)](
                streams,
                streams if rows is None else rows,
                post if prev is None else prev[0],
                comb if prev is None else prev[1],
                out if prev is None else prev[2],
                fn,
                base if base.is_contiguous() else base.contiguous(),
                scale,
                out if norm is None else norm[0],
                out if new is None else new,
                post,
                comb,
                out,
                hidden,
                streams.stride(0),
                hidden if prev is None else prev[2].stride(0),
                fn.stride(0),
                eps,
                hc_eps,
                1e-6 if norm is None else norm[1],
                N=n,
                ITERS=sinkhorn_iters,
                HEAD=head,
                PREV=prev is not None,
                STORE=new is not None,
                ROWS=rows is not None,
                NORM=norm is not None,
                ROUND=_ROUND[streams.dtype],
                BLOCK_M=triton.next_power_of_2(m),
                BLOCK_H=32,
                num_warps=4,
            )
    return new, post, comb, out


def mix(
    streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
    eps: float, hc_eps: float, sinkhorn_iters: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    _, post, comb, out = step(streams, fn, base, scale, eps, hc_eps, sinkhorn_iters)
    return post, comb, out


def collapse(
    streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
    eps: float, hc_eps: float,
) -> torch.Tensor:  # fmt: skip
    return step(streams, fn, base, scale, eps, hc_eps, 0, head=True)[3]
