"""Triton kernels for the paged KV cache, with the signatures and semantics of reference.py.

Layouts (see reference.py): one layer's cache is the strided view ``[N, 2, H_kv, B, D]``
(dim 1: 0 is K, 1 is V) of ``[num_blocks, num_layers, 2, H_kv, B, D]``; every stride is
passed to the kernels, so neither the cache view nor q has to be contiguous. A slot is
``block_id * B + offset``. The queries of a sequence are its last ``q_len`` positions,
``context_len - q_len .. context_len - 1``; key position k is visible to query position
p iff ``k <= p`` and, with a sliding window w, ``k > p - w``.

Attention runs as flash attention: scores in fp32, a running max and sum per query row
(online softmax, in base 2 with ``scale * log2(e)`` folded into the scores), the output
accumulated in fp32 and written in ``q.dtype``. As in the reference, q (and the new K/V
of ``write_kv``) are first cast to the cache dtype, by torch, so they round the same way.
Keys are walked one cache block at a time through the block table, from the first block
that the window leaves visible to the block of the tile's last query.

Deviation from the reference: ``write_kv`` skips negative slots (the usual padding
marker); the reference would write them into the last block through negative indexing.

Under Triton's interpreter (``TRITON_INTERPRET=1``) the kernels upcast K, V and q to fp32
before ``tl.dot``: the interpreter has no bfloat16 arithmetic (it would multiply the raw
bit patterns, triton-lang/triton#11584).

Constraints: head_dim and block_size must be powers of two >= 16 (``tl.arange`` needs
powers of two, ``tl.dot`` needs an inner dimension >= 16).
"""

from __future__ import annotations

import contextlib
import functools

import torch
import triton
import triton.language as tl

_LOG2E = 1.4426950408889634


@triton.jit
def _write_kv_kernel(
    cache_ptr,  # [N, 2, H_kv, B, D]
    k_ptr,  # [T, H_kv, D] in the cache dtype
    v_ptr,  # [T, H_kv, D] in the cache dtype
    slot_ptr,  # [T]
    stride_cn,
    stride_ckv,
    stride_ch,
    stride_cb,
    stride_cd,
    stride_kt,
    stride_kh,
    stride_kd,
    stride_vt,
    stride_vh,
    stride_vd,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
):
    # One program per (token, kv head): copies one K row and one V row of D elements.
    # int64 offsets: a head-major cache of an 8B model passes 2^31 elements (#13).
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:
        block = slot // BLOCK_SIZE
        offset = slot % BLOCK_SIZE
        d = tl.arange(0, HEAD_DIM)
        k = tl.load(k_ptr + t * stride_kt + h * stride_kh + d * stride_kd)  # [D]
        v = tl.load(v_ptr + t * stride_vt + h * stride_vh + d * stride_vd)  # [D]
        dst = cache_ptr + block * stride_cn + h * stride_ch + offset * stride_cb + d * stride_cd
        tl.store(dst, k)
        tl.store(dst + stride_ckv, v)


@triton.jit
def _attend_block(
    q,  # [M, D] in the cache dtype
    acc,  # [M, D] fp32, unnormalised output
    m_i,  # [M] fp32, running max of the base-2 scores
    l_i,  # [M] fp32, running sum of exp2(score - m_i)
    kv_ptrs,  # [B, D] pointers to this block's K rows (V is stride_ckv further)
    stride_ckv,
    k_ok,  # [B] key position < context_len (the rest of the block is not loaded)
    visible,  # [M, B] causal and window mask
    qk_scale,
    UPCAST: tl.constexpr,  # interpreter: compute in fp32
):
    # One online-softmax step over one cache block of keys.
    k = tl.load(kv_ptrs, mask=k_ok[:, None], other=0.0)  # [B, D]
    v = tl.load(kv_ptrs + stride_ckv, mask=k_ok[:, None], other=0.0)  # [B, D]
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    s = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale  # [M, B]
    s = tl.where(visible, s, float("-inf"))
    # m_i starts finite (-1e30), so a row with nothing visible yet gets alpha = 1, p = 0
    # instead of exp2(-inf - -inf) = NaN.
    m_new = tl.maximum(m_i, tl.max(s, 1))  # [M]
    alpha = tl.exp2(m_i - m_new)  # [M]
    p = tl.exp2(s - m_new[:, None])  # [M, B]
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
    return acc, m_new, l_i


@triton.jit
def _prefill_kernel(
    out_ptr,  # [T, H_q, D]
    q_ptr,  # [T, H_q, D] in the cache dtype
    cache_ptr,  # [N, 2, H_kv, B, D]
    cu_seqlens_ptr,  # [S + 1]
    context_lens_ptr,  # [S]
    block_tables_ptr,  # [S, max_blocks]
    qk_scale,  # scale * log2(e)
    window,  # sliding window (ignored unless USE_WINDOW)
    stride_qt,
    stride_qh,
    stride_qd,
    stride_ot,
    stride_oh,
    stride_od,
    stride_cn,
    stride_ckv,
    stride_ch,
    stride_cb,
    stride_cd,
    stride_bts,
    stride_btb,
    GROUP: tl.constexpr,  # H_q // H_kv
    USE_WINDOW: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    UPCAST: tl.constexpr,
):
    # One program per (tile of BLOCK_M queries, sequence, q head).
    tile = tl.program_id(0)
    seq = tl.program_id(1)
    # int64 offsets: a head-major cache of an 8B model passes 2^31 elements (#13).
    head = tl.program_id(2).to(tl.int64)
    kv_head = head // GROUP

    q_start = tl.load(cu_seqlens_ptr + seq).to(tl.int64)
    q_len = (tl.load(cu_seqlens_ptr + seq + 1) - q_start).to(tl.int32)
    if tile * BLOCK_M >= q_len:
        return
    ctx = tl.load(context_lens_ptr + seq).to(tl.int32)

    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)  # [M] query index within the sequence
    row_ok = rows < q_len
    q_pos = ctx - q_len + rows  # [M] absolute positions
    d = tl.arange(0, HEAD_DIM)
    tokens = (q_start + rows)[:, None]  # [M, 1] rows of q and out
    q_ptrs = q_ptr + tokens * stride_qt + head * stride_qh + d[None, :] * stride_qd
    q = tl.load(q_ptrs, mask=row_ok[:, None], other=0.0)  # [M, D]
    if UPCAST:
        q = q.to(tl.float32)

    # Blocks [lo, hi) hold every key that some query of the tile can see.
    first_pos = ctx - q_len + tile * BLOCK_M
    last_pos = ctx - q_len + tl.minimum((tile + 1) * BLOCK_M, q_len) - 1
    hi = last_pos // BLOCK_SIZE + 1
    lo = 0
    if USE_WINDOW:
        lo = tl.maximum(first_pos - window + 1, 0) // BLOCK_SIZE

    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    offs_b = tl.arange(0, BLOCK_SIZE)
    # [B, D] pointers into block 0's K of this kv head; a block's K is block_id * stride_cn on.
    head_base = (
        cache_ptr + kv_head * stride_ch + offs_b[:, None] * stride_cb + d[None, :] * stride_cd
    )
    table = block_tables_ptr + seq * stride_bts
    for j in range(lo, hi):
        block_id = tl.load(table + j * stride_btb).to(tl.int64)
        k_pos = j * BLOCK_SIZE + offs_b  # [B]
        visible = k_pos[None, :] <= q_pos[:, None]  # [M, B]
        if USE_WINDOW:
            visible = visible & (k_pos[None, :] > q_pos[:, None] - window)
        acc, m_i, l_i = _attend_block(
            q,
            acc,
            m_i,
            l_i,
            head_base + block_id * stride_cn,
            stride_ckv,
            k_pos < ctx,
            visible,
            qk_scale,
            UPCAST,
        )

    # Padding rows (rows >= q_len) may have seen nothing; they are not stored.
    l_i = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc / l_i[:, None]
    o_ptrs = out_ptr + tokens * stride_ot + head * stride_oh + d[None, :] * stride_od
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


@triton.jit
def _decode_kernel(
    out_ptr,  # [S, H_q, D], written when SPLITS == 1
    q_ptr,  # [S, H_q, D] in the cache dtype
    cache_ptr,  # [N, 2, H_kv, B, D]
    context_lens_ptr,  # [S]
    block_tables_ptr,  # [S, max_blocks]
    part_acc_ptr,  # [S, H_q, SPLITS, D] fp32: each split's unnormalised output
    part_ml_ptr,  # [S, H_q, SPLITS, 2] fp32: each split's running max and sum
    qk_scale,  # scale * log2(e)
    window,  # sliding window (ignored unless USE_WINDOW)
    stride_qs,
    stride_qh,
    stride_qd,
    stride_os,
    stride_oh,
    stride_od,
    stride_cn,
    stride_ckv,
    stride_ch,
    stride_cb,
    stride_cd,
    stride_bts,
    stride_btb,
    stride_as,
    stride_ah,
    stride_ap,
    stride_ms,
    stride_mh,
    stride_mp,
    GROUP: tl.constexpr,  # H_q // H_kv
    USE_WINDOW: tl.constexpr,
    BLOCK_G: tl.constexpr,  # GROUP padded to a power of two >= 16 (the rows of tl.dot)
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    SPLITS: tl.constexpr,  # programs per (sequence, kv head)
    UPCAST: tl.constexpr,
):
    # Program (sequence, kv head, split): the GROUP q heads that share the kv head are the
    # rows of one tile, so each K/V block is read once per kv head. With SPLITS > 1 the
    # sequence's visible blocks are cut into SPLITS equal runs (flash-decoding, so that a
    # small batch fills the GPU); each run's partial softmax goes to part_* for
    # _decode_reduce_kernel. The cut depends on the context length and SPLITS only, never on
    # the block tables' width: an eager step and a replayed CUDA graph agree bit for bit.
    seq = tl.program_id(0).to(tl.int64)
    # int64 offsets: a head-major cache of an 8B model passes 2^31 elements (#13).
    kv_head = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2)
    ctx = tl.load(context_lens_ptr + seq).to(tl.int32)
    q_pos = ctx - 1

    g = tl.arange(0, BLOCK_G)
    g_ok = g < GROUP
    heads = kv_head * GROUP + g  # [G]
    d = tl.arange(0, HEAD_DIM)
    q_ptrs = q_ptr + seq * stride_qs + heads[:, None] * stride_qh + d[None, :] * stride_qd
    q = tl.load(q_ptrs, mask=g_ok[:, None], other=0.0)  # [G, D]
    if UPCAST:
        q = q.to(tl.float32)

    hi = tl.cdiv(ctx, BLOCK_SIZE)
    lo = 0
    if USE_WINDOW:
        lo = tl.maximum(ctx - window, 0) // BLOCK_SIZE
    if SPLITS > 1:
        per_split = tl.cdiv(hi - lo, SPLITS)
        lo = lo + split * per_split
        hi = tl.minimum(hi, lo + per_split)

    m_i = tl.full([BLOCK_G], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, HEAD_DIM], tl.float32)
    offs_b = tl.arange(0, BLOCK_SIZE)
    # [B, D] pointers into block 0's K of this kv head; a block's K is block_id * stride_cn on.
    head_base = (
        cache_ptr + kv_head * stride_ch + offs_b[:, None] * stride_cb + d[None, :] * stride_cd
    )
    table = block_tables_ptr + seq * stride_bts
    for j in range(lo, hi):
        block_id = tl.load(table + j * stride_btb).to(tl.int64)
        k_pos = j * BLOCK_SIZE + offs_b  # [B]
        k_ok = k_pos < ctx
        visible = k_ok
        if USE_WINDOW:
            visible = visible & (k_pos > q_pos - window)
        visible = visible[None, :] & g_ok[:, None]  # [G, B]
        acc, m_i, l_i = _attend_block(
            q,
            acc,
            m_i,
            l_i,
            head_base + block_id * stride_cn,
            stride_ckv,
            k_ok,
            visible,
            qk_scale,
            UPCAST,
        )

    if SPLITS > 1:  # an empty split stores m = -1e30, l = 0, acc = 0: it weighs nothing
        acc_ptrs = part_acc_ptr + seq * stride_as + heads[:, None] * stride_ah + d[None, :]
        tl.store(acc_ptrs + split * stride_ap, acc, mask=g_ok[:, None])
        ml_ptrs = part_ml_ptr + seq * stride_ms + heads * stride_mh + split * stride_mp
        tl.store(ml_ptrs, m_i, mask=g_ok)
        tl.store(ml_ptrs + 1, l_i, mask=g_ok)
    else:
        # A padding row (g >= GROUP) or a context of 0 sees nothing and keeps acc = 0.
        l_i = tl.where(l_i == 0.0, 1.0, l_i)
        out = acc / l_i[:, None]
        o_ptrs = out_ptr + seq * stride_os + heads[:, None] * stride_oh + d[None, :] * stride_od
        tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=g_ok[:, None])


@triton.jit
def _decode_reduce_kernel(
    out_ptr,  # [S, H_q, D]
    part_acc_ptr,  # [S, H_q, SPLITS, D] fp32
    part_ml_ptr,  # [S, H_q, SPLITS, 2] fp32
    stride_os,
    stride_oh,
    stride_od,
    stride_as,
    stride_ah,
    stride_ap,
    stride_ms,
    stride_mh,
    stride_mp,
    GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    SPLITS: tl.constexpr,
):
    # One program per (sequence, kv head): the splits' partial softmaxes merged in split
    # order, each rescaled to their common max.
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1).to(tl.int64)
    g = tl.arange(0, BLOCK_G)
    g_ok = g < GROUP
    heads = kv_head * GROUP + g  # [G]
    d = tl.arange(0, HEAD_DIM)
    acc_ptrs = part_acc_ptr + seq * stride_as + heads[:, None] * stride_ah + d[None, :]
    ml_ptrs = part_ml_ptr + seq * stride_ms + heads * stride_mh
    m = tl.full([BLOCK_G], -1.0e30, tl.float32)
    for p in range(SPLITS):
        m = tl.maximum(m, tl.load(ml_ptrs + p * stride_mp, mask=g_ok, other=-1.0e30))
    acc = tl.zeros([BLOCK_G, HEAD_DIM], tl.float32)
    total = tl.zeros([BLOCK_G], tl.float32)
    for p in range(SPLITS):
        alpha = tl.exp2(tl.load(ml_ptrs + p * stride_mp, mask=g_ok, other=-1.0e30) - m)  # [G]
        total += alpha * tl.load(ml_ptrs + p * stride_mp + 1, mask=g_ok, other=0.0)
        acc += alpha[:, None] * tl.load(acc_ptrs + p * stride_ap, mask=g_ok[:, None], other=0.0)
    # A padding row (g >= GROUP) or a context of 0 sees nothing and keeps acc = 0.
    total = tl.where(total == 0.0, 1.0, total)
    out = acc / total[:, None]
    o_ptrs = out_ptr + seq * stride_os + heads[:, None] * stride_oh + d[None, :] * stride_od
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=g_ok[:, None])


# True when TRITON_INTERPRET was set as this module was imported (the kernels are then
# interpreter functions rather than JITFunctions).
_INTERPRETED = not isinstance(_decode_kernel, triton.runtime.JITFunction)


def _is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _check_cache(layer_cache: torch.Tensor) -> tuple[int, int, int]:
    """(H_kv, block_size, head_dim) of a ``[N, 2, H_kv, B, D]`` layer view, checked."""
    assert layer_cache.dim() == 5 and layer_cache.shape[1] == 2, (
        f"layer_cache must be [N, 2, H_kv, block_size, head_dim], got {tuple(layer_cache.shape)}"
    )
    _, _, num_kv_heads, block_size, head_dim = layer_cache.shape
    assert _is_pow2(head_dim) and head_dim >= 16, (
        f"triton kernels need head_dim to be a power of two >= 16 (64 and 128 are tested), "
        f"got {head_dim}"
    )
    assert _is_pow2(block_size) and block_size >= 16, (
        f"triton kernels need block_size to be a power of two >= 16, got {block_size}"
    )
    return num_kv_heads, block_size, head_dim


def _check_attention(
    q: torch.Tensor, layer_cache: torch.Tensor, sliding_window: int | None
) -> tuple[int, int, int, int]:
    """(GQA group, H_kv, block_size, head_dim), checked against q."""
    num_kv_heads, block_size, head_dim = _check_cache(layer_cache)
    assert q.dim() == 3 and q.shape[2] == head_dim, (
        f"q must be [tokens, H_q, {head_dim}], got {tuple(q.shape)}"
    )
    assert q.shape[1] % num_kv_heads == 0, (
        f"H_q ({q.shape[1]}) must be a multiple of H_kv ({num_kv_heads})"
    )
    assert sliding_window is None or sliding_window >= 1, (
        f"sliding_window must be None or >= 1, got {sliding_window}"
    )
    return q.shape[1] // num_kv_heads, num_kv_heads, block_size, head_dim


def _device_guard(t: torch.Tensor):
    """Launch on t's GPU (Triton uses the current device); a no-op for CPU tensors."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


MAX_DECODE_SPLITS = 32


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def decode_splits(num_seqs: int, num_kv_heads: int, device: torch.device) -> int:
    """Programs per (sequence, kv head) for a decode step of ``num_seqs`` sequences: enough
    for two programs per SM (flash-decoding at small batches), 1 once the batch fills the
    GPU. The split changes the summation order, so a step and its CUDA-graph replay must
    ask with the same (padded) batch size (common/engine/model_runner.py does)."""
    if device.type != "cuda":  # Triton's interpreter (tests pass num_splits themselves)
        return 1
    index = device.index if device.index is not None else torch.cuda.current_device()
    wanted = triton.cdiv(2 * _num_sms(index), max(1, num_seqs * num_kv_heads))
    return max(1, min(MAX_DECODE_SPLITS, wanted))


def write_kv(
    layer_cache: torch.Tensor,  # [N, 2, H_kv, B, D]
    k: torch.Tensor,  # [T, H_kv, D]
    v: torch.Tensor,  # [T, H_kv, D]
    slot_mapping: torch.Tensor,  # [T] int64, block_id * B + offset
) -> None:
    num_kv_heads, block_size, head_dim = _check_cache(layer_cache)
    num_tokens = k.shape[0]
    assert k.shape == v.shape == (num_tokens, num_kv_heads, head_dim), (
        f"k and v must be [T, {num_kv_heads}, {head_dim}], got {tuple(k.shape)}, {tuple(v.shape)}"
    )
    if num_tokens == 0:
        return
    slot_mapping = slot_mapping.contiguous()
    k, v = k.to(layer_cache.dtype), v.to(layer_cache.dtype)
    with _device_guard(layer_cache):
        _write_kv_kernel[(num_tokens, num_kv_heads)](
            layer_cache,
            k,
            v,
            slot_mapping,
            *layer_cache.stride(),
            *k.stride(),
            *v.stride(),
            BLOCK_SIZE=block_size,
            HEAD_DIM=head_dim,
        )


def _prefill_into(
    out: torch.Tensor,  # [T, H_q, D], fully overwritten
    q: torch.Tensor,
    layer_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    sliding_window: int | None,
) -> None:
    group, num_kv_heads, block_size, head_dim = _check_attention(q, layer_cache, sliding_window)
    assert out.shape == q.shape, f"out must be shaped like q {tuple(q.shape)}: {tuple(out.shape)}"
    num_seqs = context_lens.shape[0]
    if num_seqs == 0 or q.shape[0] == 0:
        return
    q = q.to(layer_cache.dtype)
    cu_seqlens_q = cu_seqlens_q.contiguous()
    context_lens = context_lens.contiguous()
    # The grid needs the longest query run: one host sync, as in the reference.
    max_q_len = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max())
    if max_q_len == 0:
        return
    block_m = min(64, max(16, triton.next_power_of_2(max_q_len)))
    grid = (triton.cdiv(max_q_len, block_m), num_seqs, q.shape[1])
    with _device_guard(q):
        _prefill_kernel[grid](
            out,
            q,
            layer_cache,
            cu_seqlens_q,
            context_lens,
            block_tables,
            scale * _LOG2E,
            sliding_window or 0,
            *q.stride(),
            *out.stride(),
            *layer_cache.stride(),
            *block_tables.stride(),
            GROUP=group,
            USE_WINDOW=sliding_window is not None,
            BLOCK_M=block_m,
            BLOCK_SIZE=block_size,
            HEAD_DIM=head_dim,
            UPCAST=_INTERPRETED,
        )


def _decode_into(
    out: torch.Tensor,  # [S, H_q, D], fully overwritten
    q: torch.Tensor,
    layer_cache: torch.Tensor,
    context_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    sliding_window: int | None,
    num_splits: int | None = None,
) -> None:
    group, num_kv_heads, block_size, head_dim = _check_attention(q, layer_cache, sliding_window)
    assert out.shape == q.shape, f"out must be shaped like q {tuple(q.shape)}: {tuple(out.shape)}"
    num_seqs = q.shape[0]
    assert context_lens.shape[0] == num_seqs, "decode: one query token per sequence"
    if num_seqs == 0:
        return
    splits = num_splits or decode_splits(num_seqs, num_kv_heads, q.device)
    q = q.to(layer_cache.dtype)
    context_lens = context_lens.contiguous()
    # [S, H_q, SPLITS, D] and [S, H_q, SPLITS, 2]; unused (never written) when SPLITS == 1
    part_acc = torch.empty(
        (num_seqs, q.shape[1], splits, head_dim), dtype=torch.float32, device=q.device
    )
    part_ml = torch.empty((num_seqs, q.shape[1], splits, 2), dtype=torch.float32, device=q.device)
    rows = dict(GROUP=group, BLOCK_G=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim)
    with _device_guard(q):
        _decode_kernel[(num_seqs, num_kv_heads, splits)](
            out,
            q,
            layer_cache,
            context_lens,
            block_tables,
            part_acc,
            part_ml,
            scale * _LOG2E,
            sliding_window or 0,
            *q.stride(),
            *out.stride(),
            *layer_cache.stride(),
            *block_tables.stride(),
            *part_acc.stride()[:3],
            *part_ml.stride()[:3],
            **rows,
            USE_WINDOW=sliding_window is not None,
            BLOCK_SIZE=block_size,
            SPLITS=splits,
            UPCAST=_INTERPRETED,
        )
        if splits > 1:
            _decode_reduce_kernel[(num_seqs, num_kv_heads)](
                out,
                part_acc,
                part_ml,
                *out.stride(),
                *part_acc.stride()[:3],
                *part_ml.stride()[:3],
                **rows,
                SPLITS=splits,
            )


def prefill_attention(
    q: torch.Tensor,  # [T, H_q, D], sequences concatenated
    layer_cache: torch.Tensor,  # [N, 2, H_kv, B, D], already holding the new K/V
    cu_seqlens_q: torch.Tensor,  # [S + 1] int, offsets of each sequence's queries in q
    context_lens: torch.Tensor,  # [S] int, cached tokens of each sequence incl. new ones
    block_tables: torch.Tensor,  # [S, max_blocks] int
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:  # [T, H_q, D]
    out = torch.empty_like(q)
    _prefill_into(
        out, q, layer_cache, cu_seqlens_q, context_lens, block_tables, scale, sliding_window
    )
    return out


def decode_attention(
    q: torch.Tensor,  # [S, H_q, D], one query token per sequence
    layer_cache: torch.Tensor,  # [N, 2, H_kv, B, D]
    context_lens: torch.Tensor,  # [S] int, incl. the token being decoded
    block_tables: torch.Tensor,  # [S, max_blocks] int
    scale: float,
    sliding_window: int | None = None,
    num_splits: int | None = None,  # None: decode_splits() for this batch
) -> torch.Tensor:  # [S, H_q, D]
    out = torch.empty_like(q)
    _decode_into(out, q, layer_cache, context_lens, block_tables, scale, sliding_window, num_splits)
    return out
