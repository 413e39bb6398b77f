"""Pointwise kernels (RMSNorm + residual, rotary, SiLU-and-mul): Triton against
``pointwise_ref``, on the GPU (``-m gpu``) or through Triton's interpreter
(``TRITON_INTERPRET=1 pytest -m interp``; tests/test_kernels.py has the three ways to run).
"""

from __future__ import annotations

import pytest
import torch

from tests.kernel_tools import (  # noqa: F401 (the *_fixture: fixtures device, gen)
    DTYPES,
    TOL,
    device_fixture,
    gen_fixture,
    rel_err,
)

# ---------------------------------------------------------------------------------------
# Pointwise kernels (RMSNorm + residual, rotary, SiLU-and-mul) against pointwise_ref, on
# the same values in the same dtype: rotary and the residual sum round exactly as torch
# does; RMSNorm's mean of squares is summed in another order (a last-bit difference).
# Triton's interpreter casts float32 to bfloat16 by truncation (the GPU rounds to nearest
# even), so under it bfloat16 results are compared with a tolerance instead.


def assert_rounds_as_torch(got, want, device):
    if device == "cuda" or want.dtype == torch.float32:
        assert torch.equal(got.cpu(), want)
    else:
        assert rel_err(got, want) < TOL[want.dtype]


@pytest.fixture
def pointwise(device):
    return pytest.importorskip("pdserve.kernels.triton_pointwise")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [576, 2048])
def test_rms_norm(pointwise, device, gen, dtype, hidden):
    from pdserve.kernels import pointwise_ref

    x = (torch.randn(7, hidden, generator=gen) * 3).to(dtype)
    res = torch.randn(7, hidden, generator=gen).to(dtype)
    w = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(dtype)
    want, _ = pointwise_ref.rms_norm(x, w, 1e-5)
    got, none = pointwise.rms_norm(x.to(device), w.to(device), 1e-5)
    # one bf16 ulp is 2^-8 relative; truncation (interpreter) costs up to one more
    tol = 1e-5 if dtype == torch.float32 else (4e-3 if device == "cuda" else TOL[dtype])
    assert none is None and got.dtype == dtype
    assert rel_err(got, want) < tol
    want, want_sum = pointwise_ref.rms_norm(x, w, 1e-5, res)
    got, got_sum = pointwise.rms_norm(x.to(device), w.to(device), 1e-5, res.to(device))
    assert_rounds_as_torch(got_sum, want_sum, device)  # the residual add rounds as torch's
    assert rel_err(got, want) < tol


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_rotary_in_place_on_packed_qkv(pointwise, device, gen, dtype, head_dim):
    from pdserve.kernels import pointwise_ref

    heads, kv_heads, tokens = 6, 2, 5
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=gen).to(dtype)
    angles = torch.rand(tokens, head_dim // 2, generator=gen) * 100
    cos = torch.cat([angles.cos()] * 2, -1).to(dtype)
    sin = torch.cat([angles.sin()] * 2, -1).to(dtype)

    def split(t):
        q, k, _ = t.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], -1)
        return q.view(tokens, heads, head_dim), k.view(tokens, kv_heads, head_dim)

    want_q, want_k = pointwise_ref.rotary(*split(qkv), cos, sin)
    packed = qkv.to(device)
    got_q, got_k = pointwise.rotary(*split(packed), cos.to(device), sin.to(device))
    # On the GPU the compiler contracts x1 * c1 + (-x2 * s1) into a fused multiply-add
    # (one rounding instead of two) where torch runs two kernels: a last-bit difference.
    # (the interpreter's truncating bf16 casts cost up to one ulp more)
    tol = 1e-6 if dtype == torch.float32 else (4e-3 if device == "cuda" else TOL[dtype])
    assert rel_err(got_q, want_q) < tol and rel_err(got_k, want_k) < tol
    assert torch.equal(split(packed)[0].cpu(), got_q.cpu())  # in place, v untouched
    assert torch.equal(
        packed[:, (heads + kv_heads) * head_dim :].cpu(), qkv[:, (heads + kv_heads) * head_dim :]
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inner", [1536, 8192])
@pytest.mark.parametrize("limit", [None, 3.0], ids=["plain", "clamped"])
def test_silu_and_mul(pointwise, device, gen, dtype, inner, limit):
    """silu(gate) * up; clamped (DeepSeek-V4's swiglu_limit: values * 4 pass 3 often)."""
    from pdserve.kernels import pointwise_ref

    x = (torch.randn(3, 2 * inner, generator=gen) * 4).to(dtype)
    want = pointwise_ref.silu_and_mul(x, limit)
    if limit is not None:
        assert not torch.equal(want, pointwise_ref.silu_and_mul(x))
    got = pointwise.silu_and_mul(x.to(device), limit)
    if dtype == torch.float32:  # exp() may differ in the last bit
        assert rel_err(got, want) < 1e-6
    else:
        assert_rounds_as_torch(got, want, device)
