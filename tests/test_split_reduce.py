"""The split-K pieces the Triton decode kernels share (kernels/triton_common.py): the
splits' reduce, the split heuristic, and the attention sink (a per-head logit in the
softmax's denominator, DeepSeek-V4's ``sinks``), in the GQA decode (triton_decode.py) and
the MLA decode (triton_mla.py), one split and several, against a dense torch softmax.
Through Triton's interpreter on CPU (``TRITON_INTERPRET=1``) or on the GPU (``-m gpu``)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tests.kernel_tools import INTERPRET, TRITON_DEVICES, device_fixture  # noqa: F401

LENS = [5, 40, 17]


def _softmax_out(scores: torch.Tensor, values: torch.Tensor, sink: torch.Tensor | None):
    """softmax over [scores, sink] times values (the sink weighs, has no value)."""
    if sink is not None:
        scores = torch.cat([scores, sink.reshape(1)])
    p = torch.softmax(scores.double(), -1)
    return p[: values.shape[0]] @ values.double()


@pytest.mark.parametrize("splits", [1, 3], ids=["one", "split3"])
@pytest.mark.parametrize("with_sinks", [False, True], ids=["plain", "sinks"])
def test_gqa_decode_with_sinks_matches_a_dense_softmax(
    device: str, splits: int, with_sinks: bool
) -> None:
    from pdserve.kernels import triton_decode

    gen = torch.Generator().manual_seed(splits + 2 * with_sinks)
    kv_heads, group, dim, block = 2, 4, 32, 16
    blocks = 3
    cache = torch.randn(len(LENS) * blocks, 2, kv_heads, block, dim, generator=gen)
    tables = torch.randperm(len(LENS) * blocks, generator=gen).view(len(LENS), blocks)
    q = torch.randn(len(LENS), kv_heads * group, dim, generator=gen)
    sinks = torch.randn(kv_heads * group, generator=gen) * 2 if with_sinks else None
    lens = torch.tensor(LENS, dtype=torch.int32)
    scale = dim**-0.5
    out = triton_decode.decode_attention(
        q.to(device), cache.to(device), lens.to(device), tables.int().to(device), scale,
        num_splits=splits, sinks=None if sinks is None else sinks.to(device),
    )  # fmt: skip
    for s, n in enumerate(LENS):
        rows = cache[tables[s]]  # [blocks, 2, H_kv, B, D]
        k = rows[:, 0].permute(1, 0, 2, 3).reshape(kv_heads, -1, dim)[:, :n]
        v = rows[:, 1].permute(1, 0, 2, 3).reshape(kv_heads, -1, dim)[:, :n]
        for h in range(kv_heads * group):
            scores = (k[h // group] @ q[s, h]) * scale
            want = _softmax_out(scores, v[h // group], None if sinks is None else sinks[h])
            torch.testing.assert_close(out[s, h].cpu().double(), want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("splits", [1, 3], ids=["one", "split3"])
@pytest.mark.parametrize("with_sinks", [False, True], ids=["plain", "sinks"])
def test_mla_decode_with_sinks_matches_a_dense_softmax(
    device: str, splits: int, with_sinks: bool
) -> None:
    """20 heads (two head tiles, the second part padding), latent 32, rope 16."""
    from pdserve.kernels import triton_mla

    gen = torch.Generator().manual_seed(10 + splits + 2 * with_sinks)
    heads, latent, rope, block, blocks = 20, 32, 16, 16, 3
    cache = torch.randn(len(LENS) * blocks, 1, 1, block, latent + rope, generator=gen)
    tables = torch.randperm(len(LENS) * blocks, generator=gen).view(len(LENS), blocks)
    q = torch.randn(len(LENS), heads, latent + rope, generator=gen) * 0.5
    sinks = torch.randn(heads, generator=gen) * 2 if with_sinks else None
    lens = torch.tensor(LENS, dtype=torch.int32)
    scale = (latent + rope) ** -0.5
    out = triton_mla.mla_decode_attention(
        q.to(device), cache.to(device), lens.to(device), tables.int().to(device), scale, latent,
        splits, None if sinks is None else sinks.to(device),
    )  # fmt: skip
    for s, n in enumerate(LENS):
        rows = cache[tables[s], 0, 0].reshape(-1, latent + rope)[:n]
        for h in range(heads):
            want = _softmax_out(
                (rows @ q[s, h]) * scale, rows[:, :latent], None if sinks is None else sinks[h]
            )
            torch.testing.assert_close(out[s, h].cpu().double(), want, rtol=1e-4, atol=1e-5)


def test_split_heuristic_fills_the_gpu_then_stops_splitting(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two programs an SM (132 SMs: 264) at small batches, capped at 32; one split once the
    tiles fill the GPU. MLA: its tile's waves x SMs programs at most (DeepSeek-V3's 128 heads
    at batch 1 in tiles of 16, 2 waves: 8 tiles, 32 splits; at batch 64 in tiles of 64, 1
    wave: 128 tiles, 1 split, at batch 16 4 splits)."""
    from pdserve.kernels import triton_common, triton_decode, triton_mla

    monkeypatch.setattr(triton_common, "_num_sms", lambda index: 132)
    cuda = SimpleNamespace(type="cuda", index=0)
    assert triton_common.decode_splits_for(1, cuda) == 32
    assert triton_common.decode_splits_for(8, cuda) == 32  # 264 / 8 = 33, capped
    assert triton_common.decode_splits_for(128, cuda) == 3
    assert triton_mla.mla_decode_splits(64, 128, cuda) == 1
    assert triton_mla.mla_decode_splits(1, 128, cuda) == 32
    large = triton_mla.DECODE_TILES[("auto", "large")]
    tiles16 = 16 * 128 // large.block_h
    assert triton_mla.mla_decode_splits(16, 128, cuda) == int(large.waves * 132) // tiles16
    assert triton_decode.decode_splits(16, 8, cuda) == 3
    assert triton_common.decode_splits_for(8, SimpleNamespace(type="cpu", index=None)) == 1
    # the MLA reduce's heads a program, from the splits (a step and its replay share them)
    assert [triton_mla.reduce_heads(n) for n in (32, 16, 8, 3, 2)] == [1, 2, 4, 8, 16]


@pytest.mark.parametrize(("block_h", "head_dim"), [(1, 128), (16, 512), (1, 512)])
def test_reduce_kernel_compiles_for_hopper(block_h: int, head_dim: int) -> None:
    """Without a GPU: the splits' reduce at the GQA decode's (one head a program, head dim
    128) and the MLA decode's (16 heads, or 1 at 32 splits: ``triton_mla.reduce_heads``;
    latent 512) sizes, 32 splits, with a sink, compiles for sm90 (Triton's ahead-of-time
    compiler)."""
    triton = pytest.importorskip("triton")
    if INTERPRET:
        pytest.skip("TRITON_INTERPRET=1: kernels are interpreter functions")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from pdserve.kernels import triton_common

    kernel = triton_common._reduce_splits_kernel
    consts = dict(HEAD_DIM=head_dim, BLOCK_H=block_h, SPLITS=32,
                  BLOCK_P=32, HAS_SINK=True)  # fmt: skip
    ptrs = {"out_ptr": "*bf16", "part_acc_ptr": "*fp32", "part_ml_ptr": "*fp32",
            "sinks_ptr": "*fp32"}  # fmt: skip
    sig = {n: ptrs.get(n, "constexpr" if n in consts else "i64") for n in kernel.arg_names}
    compiled = triton.compile(ASTSource(kernel, sig, consts), target=GPUTarget("cuda", 90, 32))
    assert compiled.metadata.shared <= 232448


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kv", ["auto", "fp8"])
def test_mla_decode_at_the_v3_shape_replays_in_a_cuda_graph(kv: str) -> None:
    """DeepSeek-V3's 128 heads over bf16 rows or fp8_ds_mla records (32 heads a program),
    batch 64, context 1024, with sinks: a CUDA-graph replay equals the eager call bit for
    bit, and the eager call the torch reference."""
    from pdserve.kernels import fp8_ds_mla, mla_reference, triton_mla

    heads, latent, rope, block, ctx, batch = 128, 512, 64, 64, 1024, 64
    gen = torch.Generator(device="cuda").manual_seed(0)
    per_seq = ctx // block
    tables = torch.randperm(batch * per_seq, device="cuda", generator=gen).int().view(batch, -1)
    lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    pos = torch.arange(ctx, device="cuda")
    slots = (tables[:, pos // block].long() * block + pos % block).flatten()
    rows = torch.randn(batch * ctx, latent + rope, device="cuda", generator=gen).bfloat16()
    width = fp8_ds_mla.record_bytes(latent, rope) if kv == "fp8" else latent + rope
    dtype = torch.uint8 if kv == "fp8" else torch.bfloat16
    cache = torch.zeros((batch * per_seq, 1, 1, block, width), dtype=dtype, device="cuda")
    triton_mla.write_latent(cache, rows, slots, latent)
    q = (torch.randn(batch, heads, latent + rope, device="cuda", generator=gen) * 0.1).bfloat16()
    sinks = torch.randn(heads, device="cuda", generator=gen)
    scale = (128 + rope) ** -0.5

    def run() -> torch.Tensor:
        return triton_mla.mla_decode_attention(q, cache, lens, tables, scale, latent, None, sinks)

    eager = run()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)
    plain = triton_mla.mla_decode_attention(q, cache, lens, tables, scale, latent)
    want = mla_reference.mla_decode_attention(
        q.float(), cache if kv == "fp8" else cache.float(), lens, tables, scale, latent
    )
    err = (plain.float() - want).norm() / want.norm()
    assert err < 2e-2, float(err)
    assert not torch.equal(plain, eager)  # the sinks weigh
