"""Paged-attention kernels: the Triton kernels against the torch reference, and the
reference against a naive dense attention (the pointwise kernels are in
tests/test_kernels_pointwise.py, the shared cases and fixtures in tests/kernel_tools.py).

Three ways to run this module:

- ``pytest tests/test_kernels.py``: the reference and dispatch tests (CPU, triton not
  needed); the Triton tests skip.
- ``pytest tests/test_kernels.py -m gpu`` on a CUDA machine: the Triton kernels on the GPU.
- ``TRITON_INTERPRET=1 pytest tests/test_kernels.py -m interp``: the same Triton tests on
  CPU through Triton's interpreter, on the smaller cases only (well under two minutes).
  The variable has to be in pytest's environment: Triton reads it when the kernels are
  decorated, i.e. when ``pdserve.kernels.triton_ops`` is first imported.

The oracle for the Triton kernels is ``reference`` run in float64 on CPU over the same
(rounded) values. The cache outside the written slots, the padding of the block tables
(which points at block 0, never written) and the kernels' outputs start as NaN, so a
read of a slot that should not be read, or an output element left unwritten, shows.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from pdserve import kernels
from pdserve.common.engine.kv_layout import LOGICAL_FROM_STORAGE
from pdserve.kernels import reference
from tests.kernel_tools import (  # noqa: F401 (the *_fixture: fixtures device, gen, ops)
    DTYPES,
    LAYER,
    NAN,
    NUM_LAYERS,
    TOL,
    WINDOWS,
    Paged,
    cpu64,
    device_fixture,
    gen_fixture,
    ops_fixture,
    random_q,
    rel_err,
)

# ---------------------------------------------------------------------------------------
# Triton kernels against the reference (GPU, or CPU through the interpreter).

# id: (seqs as (context_len, q_len), H_q, H_kv, head_dim, block_size, gpu_only)
PREFILL_CASES = {
    "len1": ([(1, 1)], 4, 4, 64, 16, False),
    "len63-gqa3": ([(63, 63)], 6, 2, 64, 16, False),
    "len64-gqa4": ([(64, 64)], 8, 2, 128, 32, False),
    "len65": ([(65, 65)], 4, 4, 128, 64, False),
    "len200-gqa4": ([(200, 200)], 8, 2, 64, 16, False),
    "ragged-gqa3": ([(1, 1), (65, 65), (200, 37), (64, 1), (130, 64)], 6, 2, 64, 32, False),
    "prefix-gqa4": ([(100, 3), (200, 130)], 4, 1, 128, 16, False),
    "long": ([(2048, 2048), (1500, 700), (4000, 1), (333, 333)], 32, 8, 128, 16, True),
}
# id: (context_lens, H_q, H_kv, head_dim, block_size, gpu_only)
DECODE_CASES = {
    "lens": ([1, 55, 63, 64, 65, 200], 4, 4, 64, 16, False),  # 55 - 24 ends a block
    "lens-gqa3": ([1, 55, 63, 64, 65, 200], 6, 2, 128, 32, False),
    "gqa4": ([200, 17, 64], 8, 2, 64, 64, False),
    # several chunks of DECODE_CHUNK_TOKENS, split over programs (flash-decoding)
    "chunks-gqa4": ([700, 1, 300, 513, 256], 8, 2, 64, 16, False),
    "long": ([4000, 1, 2500, 777] * 8, 32, 8, 128, 16, True),
    "long-batch1-gqa8": ([12000], 64, 8, 128, 64, True),
}


def _skip_big(device, gpu_only):
    if gpu_only and device == "cpu":
        pytest.skip("too big for the interpreter")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim,block_size", [(64, 16), (128, 64)])
def test_write_kv(ops, device, gen, dtype, head_dim, block_size):
    num_blocks, num_kv_heads, num_tokens = 12, 2, 100
    shape = (num_blocks, NUM_LAYERS, 2, num_kv_heads, block_size, head_dim)
    cache = torch.full(shape, NAN, dtype=dtype, device=device)
    expected = cache.clone()
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens].to(device)
    # k and v in fp32 for every cache dtype: the kernel casts them, as the reference does.
    k, v = torch.randn(2, num_tokens, num_kv_heads, head_dim, generator=gen).to(device)
    ops.write_kv(cache[:, LAYER], k, v, slots)
    reference.write_kv(expected[:, LAYER], k, v, slots)
    torch.testing.assert_close(cache, expected, rtol=0, atol=0, equal_nan=True)
    assert (~cache.isnan()).sum().item() == 2 * num_tokens * num_kv_heads * head_dim


def test_write_kv_skips_negative_slots(ops, device, gen):
    cache = torch.full((4, NUM_LAYERS, 2, 2, 16, 64), NAN, device=device)
    k, v = torch.randn(2, 3, 2, 64, generator=gen).to(device)
    ops.write_kv(cache[:, LAYER], k, v, torch.tensor([5, -1, 17], device=device))
    assert torch.equal(cache[0, LAYER, 0, :, 5], k[0])
    assert torch.equal(cache[1, LAYER, 1, :, 1], v[2])
    assert (~cache.isnan()).sum().item() == 2 * 2 * 2 * 64


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", list(PREFILL_CASES), ids=str)
def test_prefill_attention(ops, device, gen, case, dtype, window):
    seqs, num_heads, num_kv_heads, head_dim, block_size, gpu_only = PREFILL_CASES[case]
    _skip_big(device, gpu_only)
    paged = Paged([c for c, _ in seqs], num_kv_heads, head_dim, block_size, dtype, device, gen)
    q_lens = torch.tensor([n for _, n in seqs])
    cu = torch.cat([torch.zeros(1, dtype=torch.long), q_lens.cumsum(0)]).int().to(device)
    q = random_q(int(q_lens.sum()), num_heads, num_kv_heads, head_dim, dtype, device, gen)
    scale = head_dim**-0.5
    args = (paged.layer, cu, paged.context_lens, paged.block_tables, scale, window)

    out = torch.full_like(q, NAN)
    ops._prefill_into(out, q, *args)
    assert not out.isnan().any(), "output elements left unwritten (or NaN read)"
    ref = reference.prefill_attention(*map(cpu64, (q, *args)))
    assert rel_err(out, ref) < TOL[dtype]
    assert out.dtype == q.dtype
    assert torch.equal(ops.prefill_attention(q, *args), out)


@pytest.mark.parametrize("rows,warps", [(16, 4), (64, 4), (128, 8)])
@pytest.mark.parametrize("window", [None, 40])
@pytest.mark.parametrize("case", ["ragged-gqa3", "prefix-gqa4", "len200-gqa4"])
def test_prefill_launch_shapes(ops, device, gen, case, window, rows, warps):
    """Every tile height the prefill kernel can be launched with (rows of (query, head)
    pairs, kernels/triton_prefill.py) gives the reference's answer; a GQA group of 3 pads
    to 4 rows a query."""
    from pdserve.kernels.triton_prefill import PrefillConfig

    seqs, num_heads, num_kv_heads, head_dim, block_size, _ = PREFILL_CASES[case]
    dtype = torch.float32
    paged = Paged([c for c, _ in seqs], num_kv_heads, head_dim, block_size, dtype, device, gen)
    q_lens = torch.tensor([n for _, n in seqs])
    cu = torch.cat([torch.zeros(1, dtype=torch.long), q_lens.cumsum(0)]).int().to(device)
    q = random_q(int(q_lens.sum()), num_heads, num_kv_heads, head_dim, dtype, device, gen)
    args = (paged.layer, cu, paged.context_lens, paged.block_tables, head_dim**-0.5, window)
    out = torch.full_like(q, NAN)
    ops._prefill_into(out, q, *args, config=PrefillConfig(rows, warps, 2))
    assert not out.isnan().any(), "output elements left unwritten (or NaN read)"
    assert rel_err(out, reference.prefill_attention(*map(cpu64, (q, *args)))) < TOL[dtype]


@pytest.mark.parametrize("splits", [None, 3], ids=["auto", "split3"])
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", list(DECODE_CASES), ids=str)
def test_decode_attention(ops, device, gen, case, dtype, window, splits):
    ctx_lens, num_heads, num_kv_heads, head_dim, block_size, gpu_only = DECODE_CASES[case]
    _skip_big(device, gpu_only)
    paged = Paged(ctx_lens, num_kv_heads, head_dim, block_size, dtype, device, gen)
    q = random_q(len(ctx_lens), num_heads, num_kv_heads, head_dim, dtype, device, gen)
    scale = head_dim**-0.5
    args = (paged.layer, paged.context_lens, paged.block_tables, scale, window)

    out = torch.full_like(q, NAN)
    ops._decode_into(out, q, *args, splits)
    assert not out.isnan().any(), "output elements left unwritten (or NaN read)"
    ref = reference.decode_attention(*map(cpu64, (q, *args)))
    assert rel_err(out, ref) < TOL[dtype]
    assert out.dtype == q.dtype
    assert torch.equal(ops.decode_attention(q, *args, splits), out)


@pytest.mark.parametrize("window", WINDOWS)
def test_decode_bits_independent_of_table_width(ops, device, gen, window):
    """A split's run of blocks is cut from the context length alone, never from the width
    of the block tables (a replayed CUDA graph's are wider than an eager step's): with the
    same number of splits both give the same bits."""
    paged = Paged([700, 1, 300, 513], 2, 64, 16, torch.bfloat16, device, gen)
    q = random_q(4, 8, 2, 64, torch.bfloat16, device, gen)
    wide = torch.zeros(4, paged.block_tables.shape[1] + 40, dtype=torch.int32, device=device)
    wide[:, : paged.block_tables.shape[1]] = paged.block_tables
    for splits in (1, 3, 32):
        narrow_out = ops.decode_attention(
            q, paged.layer, paged.context_lens, paged.block_tables, 0.125, window, splits
        )
        wide_out = ops.decode_attention(
            q, paged.layer, paged.context_lens, wide, 0.125, window, splits
        )
        assert not narrow_out.isnan().any()
        assert torch.equal(narrow_out, wide_out), splits


def test_dispatch_picks_triton(ops, device, gen, monkeypatch):
    if device == "cpu":
        monkeypatch.setenv(kernels.ENV_VAR, "triton")
    else:
        monkeypatch.delenv(kernels.ENV_VAR, raising=False)
    assert kernels.backend_name(device) == "triton"
    paged = Paged([40, 7], 2, 64, 16, torch.float32, device, gen)
    q = random_q(2, 4, 2, 64, torch.float32, device, gen)
    args = (q, paged.layer, paged.context_lens, paged.block_tables, 0.125)
    assert torch.equal(kernels.decode_attention(*args), ops.decode_attention(*args))


@pytest.mark.parametrize("head_dim,block_size", [(48, 16), (64, 8)])
def test_triton_rejects_unsupported_shapes(ops, device, head_dim, block_size):
    cache = torch.zeros(2, 2, 1, block_size, head_dim, device=device)
    q = torch.zeros(1, 1, head_dim, device=device)
    ctx, table = torch.ones(1, dtype=torch.int32), torch.zeros(1, 1, dtype=torch.int32)
    with pytest.raises(AssertionError, match="power of two"):
        ops.decode_attention(q, cache, ctx.to(device), table.to(device), 1.0)


# ---------------------------------------------------------------------------------------
# The reference against a naive dense attention, float64 on CPU (no triton needed).


def naive_attention(q, k, v, scale, window):
    """q [q_len, H_q, D], k/v [ctx, H_kv, D]: one softmax per (query, head), by loops."""
    q_len, num_heads, _ = q.shape
    ctx, num_kv_heads, _ = k.shape
    group = num_heads // num_kv_heads
    out = torch.empty_like(q)
    for i in range(q_len):
        pos = ctx - q_len + i
        lo = 0 if window is None else max(0, pos - window + 1)
        for h in range(num_heads):
            keys, values = k[lo : pos + 1, h // group], v[lo : pos + 1, h // group]  # [n, D]
            weights = torch.softmax(keys @ q[i, h] * scale, dim=0)  # [n]
            out[i, h] = weights @ values
    return out


REF_WINDOWS = [None, 1, 10, 1000]


@pytest.mark.parametrize("window", REF_WINDOWS)
@pytest.mark.parametrize("heads", [(2, 2), (4, 2), (6, 2)], ids=["gqa1", "gqa2", "gqa3"])
def test_reference_prefill_matches_naive(gen, heads, window):
    num_heads, num_kv_heads = heads
    # Full prefills, prefixes already cached (q_len < context_len) and single tokens.
    seqs = [(1, 1), (37, 37), (70, 20), (64, 1), (50, 50), (33, 17)]
    paged = Paged([c for c, _ in seqs], num_kv_heads, 16, 16, torch.float64, "cpu", gen)
    q_lens = [n for _, n in seqs]
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(sum(q_lens), num_heads, 16, generator=gen, dtype=torch.float64)
    out = reference.prefill_attention(
        q, paged.layer, cu, paged.context_lens, paged.block_tables, 0.3, window
    )
    for s in range(len(seqs)):
        lo, hi = int(cu[s]), int(cu[s + 1])
        expected = naive_attention(q[lo:hi], paged.keys[s], paged.values[s], 0.3, window)
        torch.testing.assert_close(out[lo:hi], expected, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("window", REF_WINDOWS)
def test_reference_decode_matches_naive(gen, window):
    ctx_lens = [1, 15, 16, 17, 90]
    paged = Paged(ctx_lens, 2, 16, 16, torch.float64, "cpu", gen)
    q = torch.randn(len(ctx_lens), 8, 16, generator=gen, dtype=torch.float64)
    out = reference.decode_attention(
        q, paged.layer, paged.context_lens, paged.block_tables, 0.25, window
    )
    for s in range(len(ctx_lens)):
        expected = naive_attention(q[s : s + 1], paged.keys[s], paged.values[s], 0.25, window)
        torch.testing.assert_close(out[s : s + 1], expected, rtol=1e-10, atol=1e-12)


def test_reference_gather_roundtrip(gen):
    paged = Paged([5, 40, 16], 2, 8, 16, torch.float64, "cpu", gen)
    for s, ctx in enumerate([5, 40, 16]):
        k, v = reference.gather_kv(paged.layer, paged.block_tables[s], ctx)  # [H_kv, ctx, D]
        assert torch.equal(k, paged.keys[s].transpose(0, 1))
        assert torch.equal(v, paged.values[s].transpose(0, 1))


# ---------------------------------------------------------------------------------------
# Dispatch (no triton needed: these paths never import it).


def test_dispatch_defaults_to_torch_on_cpu(monkeypatch, gen):
    monkeypatch.delenv(kernels.ENV_VAR, raising=False)
    assert kernels.backend_name("cpu") == "torch"
    paged = Paged([9], 1, 16, 16, torch.float32, "cpu", gen)
    q = torch.randn(1, 2, 16, generator=gen)
    args = (q, paged.layer, paged.context_lens, paged.block_tables, 0.25)
    # float32 attention takes the compiled kernels (tests/test_cpu_native.py), the rest of
    # the reference as it is
    assert rel_err(kernels.decode_attention(*args), reference.decode_attention(*args)) < 1e-5
    q2 = torch.randn(2, 2, 16, generator=gen)
    prefill = (q2, paged.layer, torch.tensor([0, 2]), paged.context_lens, paged.block_tables, 0.25)
    assert (
        rel_err(kernels.prefill_attention(*prefill), reference.prefill_attention(*prefill)) < 1e-5
    )


def test_dispatch_env(monkeypatch):
    monkeypatch.setenv(kernels.ENV_VAR, "torch")
    assert kernels.backend_name("cuda") == "torch"
    monkeypatch.setenv(kernels.ENV_VAR, "cuda")
    with pytest.raises(ValueError, match="PDSERVE_KERNELS"):
        kernels.backend_name("cpu")
    monkeypatch.setenv(kernels.ENV_VAR, "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        kernels.backend_name("cpu")


# ---------------------------------------------------------------------------------------
# A cache past 2^31 elements (GPU only): an 8B model's head-major cache is one (#13).


def dense_attention(q, k, v, scale):
    """q [q_len, H_q, D], k/v [ctx, H_kv, D] float64: causal, the queries the last q_len."""
    q_len, ctx = q.shape[0], k.shape[0]
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)  # [ctx, H_q, D]
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    future = torch.arange(ctx)[None, :] > (ctx - q_len + torch.arange(q_len))[:, None]
    scores = scores.masked_fill(future, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 4, 8])
def test_kernels_past_2_31_elements(head_dim, group):
    """Head-major storage [H_kv, N, L, 2, B, D] whose upper heads start past element 2^31
    (before #13 a head's offset overflowed int32: writes and reads landed elsewhere, and
    with CUDA graphs' memory in the way the first prefill died with an illegal address).
    write_kv, prefill and decode against dense float64 attention, blocks from the top."""
    ops = pytest.importorskip("pdserve.kernels.triton_ops")
    gen = torch.Generator().manual_seed(head_dim * 10 + group)
    num_kv_heads, num_layers, block_size, dtype = 8, 2, 64, torch.bfloat16
    per_head_block = num_layers * 2 * block_size * head_dim
    num_blocks = 2**31 // ((num_kv_heads - 1) * per_head_block) + 64
    assert num_kv_heads * num_blocks * per_head_block > 2**31
    storage = (num_kv_heads, num_blocks, num_layers, 2, block_size, head_dim)
    cache = torch.full(storage, NAN, dtype=dtype, device="cuda").permute(LOGICAL_FROM_STORAGE)
    layer = cache[:, LAYER]
    ctx_lens = [300, 1000, 77]
    blocks = [math.ceil(c / block_size) for c in ctx_lens]
    ids = (num_blocks - 1 - torch.randperm(sum(blocks), generator=gen)).tolist()
    tables = torch.zeros(len(ctx_lens), max(blocks), dtype=torch.int32)
    keys, values, slots = [], [], []
    for s, (ctx, n) in enumerate(zip(ctx_lens, blocks, strict=True)):
        tables[s, :n] = torch.tensor(ids[:n])
        del ids[:n]
        pos = torch.arange(ctx)
        slots.append(tables[s, pos // block_size].long() * block_size + pos % block_size)
        for kv in (keys, values):
            kv.append(torch.randn(ctx, num_kv_heads, head_dim, generator=gen).to(dtype))
    k, v, slot = torch.cat(keys).cuda(), torch.cat(values).cuda(), torch.cat(slots).cuda()
    ops.write_kv(layer, k, v, slot)
    # every written element where it belongs, read back through torch's own indexing
    got = layer[slot // block_size, :, :, slot % block_size]  # [T, 2, H_kv, D]
    assert torch.equal(got[:, 0], k) and torch.equal(got[:, 1], v)

    num_heads, scale = num_kv_heads * group, head_dim**-0.5
    tables, ctx = tables.cuda(), torch.tensor(ctx_lens, dtype=torch.int32, device="cuda")
    # decode: one query per sequence
    q = torch.randn(len(ctx_lens), num_heads, head_dim, generator=gen).to(dtype).cuda()
    out = ops.decode_attention(q, layer, ctx, tables, scale)
    ref = torch.cat([
        dense_attention(q[s : s + 1].cpu().double(), keys[s].double(), values[s].double(), scale)
        for s in range(len(ctx_lens))
    ])  # fmt: skip
    assert rel_err(out, ref) < TOL[dtype]
    # prefill: every position of every sequence
    q = torch.randn(sum(ctx_lens), num_heads, head_dim, generator=gen).to(dtype).cuda()
    cu = torch.tensor([0, *itertools.accumulate(ctx_lens)], dtype=torch.int32, device="cuda")
    out = ops.prefill_attention(q, layer, cu, ctx, tables, scale)
    ref = torch.cat([
        dense_attention(q[cu[s] : cu[s + 1]].cpu().double(), keys[s].double(), values[s].double(), scale)
        for s in range(len(ctx_lens))
    ])  # fmt: skip
    assert rel_err(out, ref) < TOL[dtype]
