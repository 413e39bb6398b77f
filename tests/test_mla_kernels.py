"""MLA latent-cache kernels: the Triton kernels (kernels/triton_mla.py) against the torch
reference (kernels/mla_reference.py, itself checked against expanded attention in
tests/test_mla.py).

- ``pytest tests/test_mla_kernels.py -m gpu`` on a CUDA machine: Triton on the GPU,
  including the DeepSeek-V3 shape (128 heads, kv_lora_rank 512, rope 64, bf16).
- ``TRITON_INTERPRET=1 pytest tests/test_mla_kernels.py -m interp``: the small cases on CPU
  through Triton's interpreter (the variable must be set before triton is imported).

The oracle is the reference in float64 on CPU over the same rounded values; unwritten
cache slots and table padding hold NaN, so reading a slot that should not be read shows.
"""

from __future__ import annotations

import re

import pytest
import torch

from pdserve.kernels import fp8_ds_mla, mla_reference
from tests.kernel_tools import (  # noqa: F401 (the *_fixture: fixtures device, gen)
    INTERPRET,
    device_fixture,
    gen_fixture,
    triton_module,
)

NUM_LAYERS, LAYER = 3, 1  # the kernels get cache[:, LAYER], a strided view
TOL = {torch.float32: 1e-3, torch.bfloat16: 2e-2}  # ||out - ref|| / ||ref||

# (heads, kv_lora_rank, rope, block_size, context lengths); the big one on the GPU only
CASES = {
    "small": (4, 32, 16, 16, [1, 17, 40]),
    "heads20": (20, 64, 16, 32, [33, 5, 64, 100]),
    "v3": (128, 512, 64, 64, [1, 700, 2048, 64, 129]),
}
INTERP_CASES = ("small", "heads20", "fp8-small", "fp8-4tiles")
# fp8_ds_mla caches (kv_lora_rank a multiple of 128)
FP8_CASES = {
    "fp8-small": (4, 128, 16, 16, [1, 17, 40]),
    "fp8-4tiles": (4, 512, 16, 16, [3, 20]),  # four scales a record, as DeepSeek-V3's
    "fp8-v3": (128, 512, 64, 64, [1, 700, 2048, 64, 129]),
}


@pytest.fixture
def ops(device: str, monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    return triton_module("triton_mla", device, monkeypatch)


def _filled_cache(
    gen: torch.Generator, lens: list[int], width: int, block: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor], torch.Tensor]:
    """A NaN cache [N, L, 1, 1, B, D] whose LAYER holds each sequence's rows in shuffled
    blocks; returns (cache, tables, rows, slots of every row)."""
    need = [-(-n // block) for n in lens]
    num_blocks = sum(need) + 2
    ids = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()  # block 0: padding
    width_t = max(need) + 1  # one more column of padding
    tables = torch.zeros((len(lens), width_t), dtype=torch.int32)
    cache = torch.full((num_blocks, NUM_LAYERS, 1, 1, block, width), float("nan"), dtype=dtype)
    rows, slots = [], []
    for s, n in enumerate(lens):
        tables[s, : need[s]] = torch.tensor([ids.pop() for _ in range(need[s])])
        rows.append(torch.randn(n, width, generator=gen).to(dtype))
        slots.append(tables[s, torch.arange(n) // block].long() * block + torch.arange(n) % block)
    return cache, tables, rows, torch.cat(slots)


def _case(name: str, device: str) -> tuple[int, int, int, int, list[int]]:
    if device == "cpu" and name not in INTERP_CASES:
        pytest.skip("too big for Triton's interpreter")
    return CASES[name] if name in CASES else FP8_CASES[name]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("splits", [1, 3], ids=["one", "split3"])
@pytest.mark.parametrize("name", list(CASES))
def test_mla_decode_matches_reference(ops, device, gen, name, dtype, splits) -> None:  # type: ignore[no-untyped-def]
    heads, latent, rope, block, lens = _case(name, device)
    width = latent + rope
    cache, tables, rows, slots = _filled_cache(gen, lens, width, block, dtype)
    ref_cache = cache.clone()
    mla_reference.write_latent(ref_cache[:, LAYER], torch.cat(rows), slots)
    dev_cache = cache.to(device)
    ops.write_latent(dev_cache[:, LAYER], torch.cat(rows).to(device), slots.to(device))
    # the Triton write must put the same bytes where the reference does (NaN elsewhere)
    assert torch.equal(dev_cache.cpu().nan_to_num(7.0), ref_cache.nan_to_num(7.0))
    q = (torch.randn(len(lens), heads, width, generator=gen) * 0.5).to(dtype)
    lens_t = torch.tensor(lens, dtype=torch.int32)
    scale = width**-0.5
    out = ops.mla_decode_attention(
        q.to(device), dev_cache[:, LAYER], lens_t.to(device), tables.to(device), scale, latent,
        splits,
    )  # fmt: skip
    want = mla_reference.mla_decode_attention(
        q.double(), ref_cache[:, LAYER].double(), lens_t, tables, scale, latent
    )
    assert out.shape == (len(lens), heads, latent) and out.dtype == dtype
    err = (out.cpu().double() - want).norm() / want.norm()
    assert err < TOL[dtype], float(err)


def test_write_latent_skips_padding_slots(ops, device, gen) -> None:  # type: ignore[no-untyped-def]
    if device == "cpu" and not INTERPRET:
        pytest.skip("set TRITON_INTERPRET=1")
    cache = torch.zeros((4, 1, 1, 16, 48), device=device)
    rows = torch.randn(3, 48, generator=gen).to(device)
    ops.write_latent(cache, rows, torch.tensor([5, -1, 20], device=device))
    assert torch.equal(cache[0, 0, 0, 5].cpu(), rows[0].cpu())
    assert torch.equal(cache[1, 0, 0, 4].cpu(), rows[2].cpu())
    assert int((cache != 0).any(dim=-1).sum()) == 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("splits", [1, 3], ids=["one", "split3"])
@pytest.mark.parametrize("name", list(FP8_CASES))
def test_fp8_ds_mla_write_and_decode_match_reference(ops, device, gen, name, dtype, splits) -> None:  # type: ignore[no-untyped-def]
    """fp8_ds_mla (uint8) caches: the Triton write quantizes into the reference's bytes
    (padding slots skipped, 0xFF = NaN records elsewhere), and the decode kernel, which
    dequantizes in the kernel, matches the reference over the same records in float64.
    Triton's interpreter rounds fp32 -> fp8 and -> bf16 wrongly (tests/test_kernels_fp8.py):
    there the records' scales equal the reference's and most of their other bytes do."""
    heads, latent, rope, block, lens = _case(name, device)
    nan_cache, tables, rows, slots = _filled_cache(gen, lens, latent + rope, block, dtype)
    record = fp8_ds_mla.record_bytes(latent, rope)
    cache = torch.full((*nan_cache.shape[:-1], record), 255, dtype=torch.uint8)
    # tiles of different magnitudes (each its own scale), plus a padding row (slot -1)
    magnitude = torch.tensor([0.05, 1.0, 20.0, 3.0]).repeat_interleave(32)[:latent]
    magnitude = magnitude.repeat(latent // magnitude.numel())
    magnitude *= torch.tensor([1.0, 8.0, 0.25, 3.0]).repeat_interleave(128)[:latent]  # by tile
    new = torch.cat(rows + [torch.ones(1, latent + rope, dtype=dtype)])
    new[:, :latent] = (new[:, :latent].float() * magnitude).to(dtype)
    slots = torch.cat((slots, torch.tensor([-1])))
    ref_cache = cache.clone()
    mla_reference.write_latent(ref_cache[:, LAYER], new, slots, latent)
    dev_cache = cache.to(device)
    ops.write_latent(dev_cache[:, LAYER], new.to(device), slots.to(device), latent)
    got = dev_cache.cpu()
    if device != "cpu":
        assert torch.equal(got, ref_cache)
    else:
        written = (ref_cache != 255).any(-1)  # [N, L, 1, 1, B]
        assert torch.equal((got != 255).any(-1), written)
        assert int(written.sum()) == sum(lens)
        mine, theirs = got[written], ref_cache[written]  # [T, record]
        scales = slice(latent, latent + 4 * (latent // fp8_ds_mla.TILE))
        assert torch.equal(mine[:, scales], theirs[:, scales])
        # measured: about 6% of the bytes differ (a mantissa carry lost)
        assert (mine != theirs).float().mean() < 0.1
    q = (torch.randn(len(lens), heads, latent + rope, generator=gen) * 0.5).to(dtype)
    lens_t = torch.tensor(lens, dtype=torch.int32)
    scale = (latent + rope) ** -0.5
    out = ops.mla_decode_attention(
        q.to(device), dev_cache[:, LAYER], lens_t.to(device), tables.to(device), scale, latent,
        splits,
    )  # fmt: skip
    want = mla_reference.mla_decode_attention(
        q.double(), got[:, LAYER], lens_t, tables, scale, latent
    )  # over the records the kernel reads
    assert out.shape == (len(lens), heads, latent) and out.dtype == dtype
    err = (out.cpu().double() - want).norm() / want.norm()
    assert err < TOL[dtype], float(err)


def test_fp8_ds_mla_kernels_compile_for_hopper_with_the_references_rounding() -> None:
    """Without a GPU: the fp8_ds_mla write and the DS_MLA decode kernel compile for sm90
    (Triton's ahead-of-time compiler), and the write's PTX rounds as the torch reference:
    IEEE divisions, fp32 -> e4m3 and -> bf16 to nearest even (so the GPU write test can ask
    for equal bytes)."""
    triton = pytest.importorskip("triton")
    if INTERPRET:
        pytest.skip("TRITON_INTERPRET=1: kernels are interpreter functions")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from pdserve.kernels import triton_mla, triton_mla_fp8

    target = GPUTarget("cuda", 90, 32)
    write = triton_mla_fp8._write_ds_mla_kernel
    consts = {"LATENT": 512, "ROPE": 64, "TILE": 128, "BLOCK_SIZE": 64, "FP8_LIMIT": 448.0,
              "MIN_SCALE": fp8_ds_mla.MIN_SCALE}  # fmt: skip
    ptrs = {"cache_ptr": "*u8", "row_ptr": "*fp32", "slot_ptr": "*i64"}
    sig = {n: ptrs.get(n, "constexpr" if n in consts else "i64") for n in write.arg_names}
    ptx = triton.compile(ASTSource(write, sig, consts), target=target).asm["ptx"]
    assert "div.rn.f32" in ptx and "div.full" not in ptx and "div.approx" not in ptx
    assert "cvt.rn.satfinite.e4m3x2.f32" in ptx and "cvt.rn.bf16.f32" in ptx
    decode = triton_mla._mla_decode_kernel
    consts = dict(LATENT=512, ROPE=64, BLOCK_H=16, BLOCK_SIZE=64, BLOCK_N=32, SPLITS=2,
                  UPCAST=False, DS_MLA=True, TILE=128, HAS_SINK=False, LAZY=False,
                  IDS=triton_mla.DECODE_IDS)  # fmt: skip
    ptrs = {"out_ptr": "*bf16", "q_ptr": "*bf16", "cache_ptr": "*u8", "context_lens_ptr": "*i32",
            "block_tables_ptr": "*i32", "part_acc_ptr": "*fp32", "part_ml_ptr": "*fp32",
            "qk_scale": "fp32"}  # fmt: skip
    sig = {n: ptrs.get(n, "constexpr" if n in consts else "i64") for n in decode.arg_names}
    ptx = triton.compile(ASTSource(decode, sig, consts), target=target).asm["ptx"]
    assert "e4m3" in ptx  # the records' fp8 values converted in the kernel


SM90_SHARED = 232448  # bytes of shared memory one program may take on sm90 (227 KB)


def _sm90_decode(dtype: str, ds_mla: bool, tile):  # type: ignore[no-untyped-def]
    """The decode kernel compiled for sm90 at DeepSeek-V3's shape (LATENT 512, ROPE 64, block
    64) as a launch specializes it: unit strides constant, pointers and the other strides
    16-aligned (so its loads pipeline into shared memory, as they do on the GPU)."""
    triton = pytest.importorskip("triton")
    if INTERPRET:
        pytest.skip("TRITON_INTERPRET=1: kernels are interpreter functions")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from pdserve.kernels import triton_mla

    decode = triton_mla._mla_decode_kernel
    consts = dict(LATENT=512, ROPE=64, BLOCK_H=tile.block_h, BLOCK_SIZE=64, BLOCK_N=tile.block_n,
                  SPLITS=2, UPCAST=False, DS_MLA=ds_mla, TILE=128, HAS_SINK=False,
                  LAZY=tile.lazy, IDS=triton_mla.DECODE_IDS, stride_qd=1, stride_od=1,
                  stride_cd=1)  # fmt: skip
    ptrs = {"out_ptr": f"*{dtype}", "q_ptr": f"*{dtype}", "cache_ptr": "*u8" if ds_mla else
            f"*{dtype}", "context_lens_ptr": "*i32", "block_tables_ptr": "*i32",
            "part_acc_ptr": "*fp32", "part_ml_ptr": "*fp32", "qk_scale": "fp32"}  # fmt: skip
    sig = {n: ptrs.get(n, "constexpr" if n in consts else "i64") for n in decode.arg_names}
    aligned = {i for i, n in enumerate(decode.arg_names) if n.endswith("_ptr") or
               n.startswith("stride_") and n not in consts and n not in ("stride_bts",
               "stride_btb", "stride_ms", "stride_mh", "stride_mp")}  # fmt: skip
    attrs = {(i,): [["tt.divisibility", 16]] for i in aligned if decode.arg_names[i] != "sinks_ptr"}
    return triton.compile(
        ASTSource(decode, sig, consts, attrs),
        target=GPUTarget("cuda", 90, 32),
        options={"num_warps": tile.num_warps, "num_stages": tile.num_stages},
    )


def _default_tiles() -> list:  # type: ignore[type-arg]
    """(dtype, ds_mla, batch) of every default tile but float32 q over an auto cache (182 KB,
    30 s to compile)."""
    from pdserve.kernels import triton_mla

    cases = [("bf16", cache == "fp8", 1 if regime == "small" else 64)
             for cache, regime in triton_mla.DECODE_TILES]  # fmt: skip
    return [pytest.param(*c, id=f"{c[0]}-{'fp8' if c[1] else 'auto'}-batch{c[2]}")
            for c in cases + [("fp32", True, 1)]]  # fmt: skip


@pytest.mark.parametrize(("dtype", "ds_mla", "batch"), _default_tiles())
def test_mla_decode_fits_hopper_shared_memory_at_the_v3_shape(
    dtype: str, ds_mla: bool, batch: int
) -> None:
    """Without a GPU: the decode kernel at DeepSeek-V3's shape with each tile ``decode_tile``
    picks compiles for sm90 within its shared memory (above it the launch fails: the fp8
    fp32 GPU cases did, at 300 KB), with its warps; 64 heads a program take Hopper's
    warpgroup MMA, and the cache loads are pipelined (asynchronous copies)."""
    from pdserve.kernels import triton_mla

    q_dtype = torch.float32 if dtype == "fp32" else torch.bfloat16
    tile = triton_mla.decode_tile(ds_mla, q_dtype, 64, batch)
    compiled = _sm90_decode(dtype, ds_mla, tile)
    assert compiled.metadata.num_warps == tile.num_warps
    assert compiled.metadata.shared <= SM90_SHARED, compiled.metadata.shared
    ptx = compiled.asm["ptx"]
    assert "cp.async" in ptx
    if tile.block_h >= 64:
        assert "wgmma.mma_async" in ptx
    # the key loop (the innermost) waits for a tile's copies with later tiles' still in
    # flight: no wait there for every copy (``num = 0``), which a block id loaded in that
    # loop had made Triton put at each tile
    waits = [(len(line) - len(line.lstrip()), int(re.search(r"num = (\d+)", line)[1]))
             for line in compiled.asm["ttgir"].splitlines() if "ttg.async_wait" in line]  # fmt: skip
    deepest = max(indent for indent, _ in waits)
    assert all(num >= 1 for indent, num in waits if indent == deepest), waits


def _sweep_tiles() -> list:  # type: ignore[type-arg]
    """Every distinct tile of DECODE_TILES, SWEEP_TILES and FP32_TILES, by cache."""
    from pdserve.kernels import triton_mla

    tiles = {(cache, t) for (cache, _), t in triton_mla.DECODE_TILES.items()}
    tiles |= {(cache, t) for (cache, _), ts in triton_mla.SWEEP_TILES.items() for t in ts}
    tiles |= set(triton_mla.FP32_TILES.items())
    return [pytest.param(cache, t, id=f"{cache}-h{t.block_h}-n{t.block_n}-w{t.num_warps}-"
                         f"s{t.num_stages}-x{t.waves:g}{'-lazy' if t.lazy else ''}")
            for cache, t in sorted(tiles, key=str)]  # fmt: skip


# (heads, kv_lora_rank, rope, block_size, context lengths): 20 heads (a partial head tile at
# 16, 44 rows of padding at 64), blocks of 64 keys (BLOCK_N 16..64 a block)
TILE_CASES = {
    "cpu": {"auto": (20, 64, 16, 64, [1, 70, 130]), "fp8": (20, 128, 16, 64, [1, 70, 130])},
    "cuda": {
        c: (128, 512, 64, 64, [1, 700, 2048, 64, 129, 9, 1000, 300, 2000]) for c in ("auto", "fp8")
    },  # fmt: skip
}


@pytest.mark.parametrize("splits", [1, 3], ids=["one", "split3"])
@pytest.mark.parametrize(("cache_kind", "tile"), _sweep_tiles())
def test_every_decode_tile_matches_reference(ops, device, gen, monkeypatch, cache_kind, tile,
                                             splits) -> None:  # type: ignore[no-untyped-def]  # fmt: skip
    """Each tile the defaults or the sweep may launch (heads a program, keys a tile, warps,
    stages), bf16 q over an auto and an fp8_ds_mla cache: the kernel matches the reference
    over the same cache (fp8: the records the kernel reads). Interpreter: small shapes; GPU:
    DeepSeek-V3's, 9 sequences."""
    triton = pytest.importorskip("triton")
    heads, latent, rope, block, lens = TILE_CASES[device][cache_kind]
    dtype = torch.bfloat16
    monkeypatch.setattr(ops, "decode_tile", lambda *_: tile)
    cache, tables, rows, slots = _filled_cache(gen, lens, latent + rope, block, dtype)
    # the last sequence's last rows 20x larger: its running max jumps by far more than 2^8
    # in its last tile (a lazy tile's rescale then runs mid-sequence)
    rows[-1][-5:] *= 20
    if cache_kind == "fp8":
        record = fp8_ds_mla.record_bytes(latent, rope)
        cache = torch.full((*cache.shape[:-1], record), 255, dtype=torch.uint8)
    dev_cache = cache.to(device)
    ops.write_latent(dev_cache[:, LAYER], torch.cat(rows).to(device), slots.to(device), latent)
    q = (torch.randn(len(lens), heads, latent + rope, generator=gen) * 0.5).to(dtype)
    lens_t = torch.tensor(lens, dtype=torch.int32)
    scale = (latent + rope) ** -0.5
    try:
        out = ops.mla_decode_attention(
            q.to(device), dev_cache[:, LAYER], lens_t.to(device), tables.to(device), scale,
            latent, splits,
        )  # fmt: skip
    except triton.runtime.errors.OutOfResources as e:  # a sweep candidate may not fit: the
        defaults = {*ops.DECODE_TILES.values(), *ops.FP32_TILES.values()}  # sweep says so
        if tile in defaults:
            raise
        pytest.skip(f"a sweep candidate over this GPU's resources: {e}")
    ref_cache = dev_cache[:, LAYER] if cache_kind == "fp8" else dev_cache[:, LAYER].double()
    want = mla_reference.mla_decode_attention(
        q.double().to(device), ref_cache, lens_t.to(device), tables.to(device), scale, latent
    ).cpu()  # in float64 where the kernel ran: the same records, faster on the GPU
    assert out.shape == (len(lens), heads, latent) and out.dtype == dtype
    err = (out.cpu().double() - want).norm() / want.norm()
    assert err < TOL[dtype], float(err)


@pytest.mark.parametrize("splits", [1, 3], ids=["one", "split3"])
@pytest.mark.parametrize("cache_kind", ["auto", "fp8"])
def test_decode_walks_the_block_ids_a_run_at_a_time(ops, device, gen, monkeypatch, cache_kind,
                                                    splits) -> None:  # type: ignore[no-untyped-def]  # fmt: skip
    """The kernel loads a sequence's block ids DECODE_IDS at a time (its key loop runs over
    each run's tiles); at 2 ids a run and 2 tiles a block, contexts of up to 9 blocks take
    several runs, a split's last one partial: the kernel still matches the reference."""
    from pdserve.kernels.triton_mla import DecodeTile

    monkeypatch.setattr(ops, "DECODE_IDS", 2)
    monkeypatch.setattr(ops, "decode_tile", lambda *_: DecodeTile(16, 16, 4, 3))
    heads, latent, rope, block = 4, 128, 16, 32
    lens = [1, 40, 97, 270]
    cache, tables, rows, slots = _filled_cache(gen, lens, latent + rope, block, torch.bfloat16)
    if cache_kind == "fp8":
        record = fp8_ds_mla.record_bytes(latent, rope)
        cache = torch.full((*cache.shape[:-1], record), 255, dtype=torch.uint8)
    dev_cache = cache.to(device)
    ops.write_latent(dev_cache[:, LAYER], torch.cat(rows).to(device), slots.to(device), latent)
    q = (torch.randn(len(lens), heads, latent + rope, generator=gen) * 0.5).bfloat16()
    lens_t, scale = torch.tensor(lens, dtype=torch.int32), (latent + rope) ** -0.5
    out = ops.mla_decode_attention(
        q.to(device), dev_cache[:, LAYER], lens_t.to(device), tables.to(device), scale, latent,
        splits,
    )  # fmt: skip
    ref_cache = dev_cache[:, LAYER] if cache_kind == "fp8" else dev_cache[:, LAYER].double()
    want = mla_reference.mla_decode_attention(
        q.double().to(device), ref_cache, lens_t.to(device), tables.to(device), scale, latent
    ).cpu()
    err = (out.cpu().double() - want).norm() / want.norm()
    assert err < TOL[torch.bfloat16], float(err)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("cache_kind", ["auto", "fp8"])
@pytest.mark.parametrize("batch", [1, 12, 64])
def test_cuda_graph_replay_equals_eager_decode(gen, cache_kind: str, batch: int) -> None:
    """At DeepSeek-V3's shape, the defaults of each batch regime (1: small; 12, 64: large)
    with the splits ``mla_decode_splits`` gives the batch: a CUDA-graph replay of the decode
    equals the eager call bit for bit, and both the reference."""
    from pdserve.kernels import triton_mla

    heads, latent, rope, block = 128, 512, 64, 64
    lens = [(i * 397) % 2048 + 1 for i in range(batch)]
    cache, tables, rows, slots = _filled_cache(gen, lens, latent + rope, block, torch.bfloat16)
    cache = cache[:, LAYER].contiguous()
    if cache_kind == "fp8":
        record = fp8_ds_mla.record_bytes(latent, rope)
        cache = torch.full((*cache.shape[:-1], record), 255, dtype=torch.uint8)
    cache, tables = cache.cuda(), tables.cuda()
    triton_mla.write_latent(cache, torch.cat(rows).cuda(), slots.cuda(), latent)
    q = (torch.randn(batch, heads, latent + rope, generator=gen) * 0.5).bfloat16().cuda()
    lens_t = torch.tensor(lens, dtype=torch.int32).cuda()
    scale = (latent + rope) ** -0.5
    splits = triton_mla.mla_decode_splits(batch, heads, q.device)
    args = (q, cache, lens_t, tables, scale, latent, splits)
    eager = triton_mla.mla_decode_attention(*args)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = triton_mla.mla_decode_attention(*args)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, eager)
    ref_cache = cache if cache_kind == "fp8" else cache.double()
    want = mla_reference.mla_decode_attention(q.double(), ref_cache, lens_t, tables, scale, latent)
    err = (eager.double() - want).norm() / want.norm()
    assert err < TOL[torch.bfloat16], float(err)
