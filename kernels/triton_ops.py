"""Triton kernels for the paged KV cache, with the signatures and semantics of reference.py:
``write_kv`` here, prefill in ``triton_prefill.py``, decode in ``triton_decode.py``, what
they share (and the fp8 rules) in ``triton_common.py``.

Layouts, the softmax, fp8 handling, the interpreter and the shape constraints: see
triton_common.py. Deviation from the reference: ``write_kv`` skips negative slots (the usual
padding marker); the reference would write them into the last block through negative
indexing.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.kernels.fp8 import FP8_MAX, is_fp8
from pdserve.kernels.triton_common import (
    _check_cache,
    _device_guard,
)
from pdserve.kernels.triton_decode import (  # noqa: F401 - the module's public surface
    MAX_DECODE_SPLITS,
    _decode_into,
    decode_attention,
    decode_splits,
)
from pdserve.kernels.triton_prefill import (  # noqa: F401 - the module's public surface
    _prefill_into,
    prefill_attention,
)


@triton.jit
def _write_kv_kernel(
    cache_ptr,  # [N, 2, H_kv, B, D]
    k_ptr,  # [T, H_kv, D] in the cache dtype (fp8 caches: in the model's, quantized here)
    v_ptr,  # [T, H_kv, D]
    slot_ptr,  # [T]
    inv_k_scale,  # fp8: stored = k * (1 / k_scale)
    inv_v_scale,
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
    FP8: tl.constexpr,
    FP8_LIMIT: tl.constexpr,
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
        if FP8:  # saturate: e4m3fn has no infinity, an overflow would store NaN
            k = tl.minimum(tl.maximum(k.to(tl.float32) * inv_k_scale, -FP8_LIMIT), FP8_LIMIT)
            v = tl.minimum(tl.maximum(v.to(tl.float32) * inv_v_scale, -FP8_LIMIT), FP8_LIMIT)
            k = k.to(cache_ptr.dtype.element_ty, fp_downcast_rounding="rtne")
            v = v.to(cache_ptr.dtype.element_ty, fp_downcast_rounding="rtne")
        dst = cache_ptr + block * stride_cn + h * stride_ch + offset * stride_cb + d * stride_cd
        tl.store(dst, k)
        tl.store(dst + stride_ckv, v)


def write_kv(
    layer_cache: torch.Tensor,  # [N, 2, H_kv, B, D]
    k: torch.Tensor,  # [T, H_kv, D]
    v: torch.Tensor,  # [T, H_kv, D]
    slot_mapping: torch.Tensor,  # [T] int64, block_id * B + offset
    k_scale: float = 1.0,  # fp8 caches: stored = k / k_scale
    v_scale: float = 1.0,
) -> None:
    num_kv_heads, block_size, head_dim = _check_cache(layer_cache)
    num_tokens = k.shape[0]
    assert k.shape == v.shape == (num_tokens, num_kv_heads, head_dim), (
        f"k and v must be [T, {num_kv_heads}, {head_dim}], got {tuple(k.shape)}, {tuple(v.shape)}"
    )
    if num_tokens == 0:
        return
    slot_mapping = slot_mapping.contiguous()
    fp8 = is_fp8(layer_cache.dtype)
    if not fp8:
        k, v = k.to(layer_cache.dtype), v.to(layer_cache.dtype)
    with _device_guard(layer_cache):
        _write_kv_kernel[(num_tokens, num_kv_heads)](
            layer_cache,
            k,
            v,
            slot_mapping,
            1.0 / k_scale,
            1.0 / v_scale,
            *layer_cache.stride(),
            *k.stride(),
            *v.stride(),
            BLOCK_SIZE=block_size,
            HEAD_DIM=head_dim,
            FP8=fp8,
            FP8_LIMIT=FP8_MAX,
        )
