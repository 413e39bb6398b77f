"""What the Triton paged-attention kernels share (``triton_ops.py``: write and prefill,
``triton_decode.py``: decode), with the signatures and semantics of reference.py.

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

fp8 caches (float8_e4m3fn): the write kernel quantizes in the kernel (K times
``1 / k_scale``, saturated to +-448, rounded to nearest even, as kernels/fp8.py does) and the
attention kernels load fp8 and dequantize in the kernel (times ``k_scale`` in fp32, then to
q's dtype); q is then never cast to the cache dtype, the dots run in q's dtype.

Constraints: head_dim and block_size must be powers of two >= 16 (``tl.arange`` needs
powers of two, ``tl.dot`` needs an inner dimension >= 16).

Split-K decode (flash decoding), shared by ``triton_decode.py`` and ``triton_mla.py``: a
program of (sequence, head tile, split) walks one run of the context's blocks and either
finishes its rows (``finish_rows``: one split) or stores its partial softmax
(``store_partials``: running max and sum in base 2, unnormalised output, fp32) for
``reduce_splits``, which merges a sequence's splits at their common max in split order.
Either end may add an attention sink: a per-head logit (natural-log units) that joins the
softmax's denominator and no value (DeepSeek-V4's ``sinks``, gpt-oss's). How many splits:
``decode_splits_for``.
"""

from __future__ import annotations

import contextlib
import functools

import torch
import triton
import triton.language as tl

from pdserve.kernels.fp8 import is_fp8

_LOG2E = 1.4426950408889634
MAX_DECODE_SPLITS = 32


@triton.jit
def _softmax_step(q, k, v, acc, m_i, l_i, visible, qk_scale, MASK: tl.constexpr):
    # One online-softmax step over one block of keys (base 2, scale folded into qk_scale).
    s = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale  # [M, B]
    if MASK:
        s = tl.where(visible, s, float("-inf"))
    # m_i starts finite (-1e30): a row with nothing visible yet gets alpha = 1, p = 0.
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
    return acc, m_new, l_i


@triton.jit
def _load_kv(ptrs, stride_ckv, ok, k_scale, v_scale, dtype, MASK: tl.constexpr,
             FP8: tl.constexpr, UPCAST: tl.constexpr):  # fmt: skip
    # One cache block's K and V rows [B, D]; masked loads only at the context's end.
    if MASK:
        k = tl.load(ptrs, mask=ok[:, None], other=0.0)
        v = tl.load(ptrs + stride_ckv, mask=ok[:, None], other=0.0)
    else:
        k = tl.load(ptrs)
        v = tl.load(ptrs + stride_ckv)
    if FP8:
        k = (k.to(tl.float32) * k_scale).to(dtype)
        v = (v.to(tl.float32) * v_scale).to(dtype)
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    return k, v


@triton.jit
def _attend_block(
    q,  # [M, D] in the compute dtype (compute_dtype: the cache's, or q's over fp8)
    acc,  # [M, D] fp32, unnormalised output
    m_i,  # [M] fp32, running max of the base-2 scores
    l_i,  # [M] fp32, running sum of exp2(score - m_i)
    kv_ptrs,  # [B, D] pointers to this block's K rows (V is stride_ckv further)
    stride_ckv,
    k_ok,  # [B] key position < context_len (the rest of the block is not loaded)
    visible,  # [M, B] causal and window mask
    qk_scale,
    k_scale,  # fp8 caches: K = stored * k_scale
    v_scale,
    FP8: tl.constexpr,  # the cache holds float8_e4m3fn: dequantize into q's dtype
    UPCAST: tl.constexpr,  # interpreter: compute in fp32
):
    # One online-softmax step over one cache block of keys, masked.
    k, v = _load_kv(kv_ptrs, stride_ckv, k_ok, k_scale, v_scale, q.dtype, True, FP8, UPCAST)
    return _softmax_step(q, k, v, acc, m_i, l_i, visible, qk_scale, True)


# True when TRITON_INTERPRET was set as this module was imported (the kernels are then
# interpreter functions rather than JITFunctions).
_INTERPRETED = not isinstance(_attend_block, triton.runtime.JITFunction)


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


def compute_dtype(q: torch.Tensor, layer_cache: torch.Tensor) -> torch.dtype:
    """The dtype the dots run in: the cache's, or q's when the cache is fp8 (dequantized)."""
    return q.dtype if is_fp8(layer_cache.dtype) else layer_cache.dtype


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def decode_splits_for(tiles: int, device: torch.device) -> int:
    """Splits of each of a decode step's ``tiles`` programs ((sequence, head tile) pairs)
    so that about two programs run per SM (flash decoding, for small batches), 1 once the
    tiles alone fill the GPU. The split changes the summation order, so a step and its
    CUDA-graph replay must ask with the same (padded) batch size
    (common/engine/model_runner.py does). Off CUDA (the interpreter) 1: tests pass theirs."""
    if device.type != "cuda":
        return 1
    index = device.index if device.index is not None else torch.cuda.current_device()
    wanted = triton.cdiv(2 * _num_sms(index), max(1, tiles))
    return max(1, min(MAX_DECODE_SPLITS, wanted))


@triton.jit
def finish_rows(acc, m_i, l_i, sink, HAS_SINK: tl.constexpr):
    """The output rows of one split-free program: ``acc / l``, a row that saw nothing left
    at 0; with a sink (``sink``: [rows] logits in base-2 units, scale not applied) its
    ``exp2(sink - m)`` joins the denominator."""
    if HAS_SINK:
        l_i = l_i + tl.exp2(sink - m_i)
    l_i = tl.where(l_i == 0.0, 1.0, l_i)
    return acc / l_i[:, None]


@triton.jit
def store_partials(part_acc_ptr, part_ml_ptr, seq, heads, split, d, acc, m_i, l_i, ok,
                   stride_as, stride_ah, stride_ap, stride_ms, stride_mh, stride_mp):  # fmt: skip
    # One split's rows [H_t, D] of unnormalised output and their running max and sum. An
    # empty split stores m = -1e30, l = 0, acc = 0: it weighs nothing in the reduce.
    acc_ptrs = part_acc_ptr + seq * stride_as + heads[:, None] * stride_ah + d[None, :]
    tl.store(acc_ptrs + split * stride_ap, acc, mask=ok[:, None])
    ml_ptrs = part_ml_ptr + seq * stride_ms + heads * stride_mh + split * stride_mp
    tl.store(ml_ptrs, m_i, mask=ok)
    tl.store(ml_ptrs + 1, l_i, mask=ok)


@triton.jit
def _reduce_splits_kernel(
    out_ptr,  # [S, H, D]
    part_acc_ptr,  # [S, H, SPLITS, D] fp32
    part_ml_ptr,  # [S, H, SPLITS, 2] fp32
    sinks_ptr,  # [H] fp32 (read when HAS_SINK)
    num_heads,
    stride_os,
    stride_oh,
    stride_od,
    stride_as,
    stride_ah,
    stride_ap,
    stride_ms,
    stride_mh,
    stride_mp,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    SPLITS: tl.constexpr,
    BLOCK_P: tl.constexpr,  # SPLITS rounded up to a power of two
    HAS_SINK: tl.constexpr,
):
    # One program per (sequence, BLOCK_H heads): every split's max and sum loaded as one
    # [H_t, P] tile, then the splits' outputs added in split order, each an independent
    # load (unrolled: no chain of dependent loads, which left a batch of 1 at 11 us a layer
    # on the H200 when a program looped over its splits rescaling as it went).
    seq = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1).to(tl.int64) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = heads < num_heads
    p = tl.arange(0, BLOCK_P)
    d = tl.arange(0, HEAD_DIM)
    ml_ptrs = part_ml_ptr + seq * stride_ms + heads[:, None] * stride_mh + p[None, :] * stride_mp
    ok = h_ok[:, None] & (p < SPLITS)[None, :]
    m_p = tl.load(ml_ptrs, mask=ok, other=-1.0e30)  # [H_t, P] each split's max (base 2)
    l_p = tl.load(ml_ptrs + 1, mask=ok, other=0.0)  # [H_t, P] each split's sum
    m = tl.max(m_p, axis=1)
    if HAS_SINK:
        sink = tl.load(sinks_ptr + heads, mask=h_ok, other=0.0).to(tl.float32) * 1.4426950408889634
        m = tl.maximum(m, sink)
    alpha = tl.exp2(m_p - m[:, None])
    total = tl.sum(alpha * l_p, axis=1)
    if HAS_SINK:
        total += tl.exp2(sink - m)
    acc_ptrs = part_acc_ptr + seq * stride_as + heads[:, None] * stride_ah + d[None, :]
    acc = tl.zeros([BLOCK_H, HEAD_DIM], tl.float32)
    for q in tl.static_range(SPLITS):
        a_q = tl.sum(tl.where(p[None, :] == q, alpha, 0.0), axis=1)  # [H_t] split q's weight
        acc += a_q[:, None] * tl.load(acc_ptrs + q * stride_ap, mask=h_ok[:, None], other=0.0)
    # A context of 0 sees nothing: its splits sum to 0 and it keeps acc = 0.
    out = acc / tl.where(total == 0.0, 1.0, total)[:, None]
    o_ptrs = out_ptr + seq * stride_os + heads[:, None] * stride_oh + d[None, :] * stride_od
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=h_ok[:, None])


def reduce_splits(
    out: torch.Tensor,  # [S, H, D], fully overwritten
    part_acc: torch.Tensor,  # [S, H, SPLITS, D] fp32
    part_ml: torch.Tensor,  # [S, H, SPLITS, 2] fp32
    sinks: torch.Tensor | None = None,  # [H] per-head sink logits (natural-log units)
    block_h: int = 16,
) -> None:
    """Merge each sequence's split partials into ``out`` (and a sink per head)."""
    num_seqs, num_heads, splits, head_dim = part_acc.shape
    block_h = min(block_h, triton.next_power_of_2(num_heads))
    with _device_guard(out):
        _reduce_splits_kernel[(num_seqs, triton.cdiv(num_heads, block_h))](
            out,
            part_acc,
            part_ml,
            part_ml if sinks is None else sinks,
            num_heads,
            *out.stride(),
            *part_acc.stride()[:3],
            *part_ml.stride()[:3],
            HEAD_DIM=head_dim,
            BLOCK_H=block_h,
            SPLITS=splits,
            BLOCK_P=triton.next_power_of_2(splits),
            HAS_SINK=sinks is not None,
        )


def check_sinks(sinks: torch.Tensor | None, num_heads: int) -> torch.Tensor | None:
    """``sinks`` as the kernels read them: [H] float32, contiguous."""
    if sinks is None:
        return None
    assert sinks.shape == (num_heads,), f"sinks must be [{num_heads}], got {tuple(sinks.shape)}"
    return sinks.float().contiguous()
