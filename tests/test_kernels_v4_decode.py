"""kernels/triton_v4_decode.py (DeepSeek-V4 attention's small per-step ops, one launch each)
against their torch references in kernels/v4_ops.py (the CPU path, op for op as
transformers): on the GPU (``gpu``) and on CPU through Triton's interpreter (``interp``:
``TRITON_INTERPRET=1 pytest tests/test_kernels_v4_decode.py -m interp``)."""

from __future__ import annotations

import pytest
import torch

from pdserve.kernels import v4_ops
from tests.kernel_tools import (  # noqa: F401 (the *_fixture: fixtures device, gen)
    device_fixture,
    fix_interpreter_index,
    gen_fixture,
    rel_err,
    triton_module,
)

NAN = float("nan")


@pytest.fixture
def ops(device: str, monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    return triton_module("triton_v4_decode", device, monkeypatch)


def _ref(x, weight, eps, cos, sin, inverse):  # type: ignore[no-untyped-def]
    """v4_ops.norm_rope's torch path (today's CPU arithmetic), whatever the backend."""
    if eps is not None:
        x = v4_ops.rms_ref(x, eps) if weight is None else v4_ops.rms_norm_ref(x, weight, eps)
    if cos is not None:
        x = v4_ops.rope_ref(x, cos, -sin if inverse else sin)
    return x


MODES = [  # (norm, rope, inverse)
    pytest.param(None, True, False, id="rope"),
    pytest.param(None, True, True, id="unrope"),
    pytest.param("rms", True, False, id="rms_rope"),
    pytest.param("weighted", True, False, id="norm_rope"),
    pytest.param("weighted", False, False, id="norm"),
    pytest.param("rms", False, False, id="rms"),
]


@pytest.mark.parametrize(("norm", "rope", "inverse"), MODES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("heads", [0, 3], ids=["rows", "heads"])
def test_norm_rope_matches_reference(  # type: ignore[no-untyped-def]
    ops, device: str, gen: torch.Generator, norm, rope: bool, inverse: bool,
    dtype: torch.dtype, heads: int,
) -> None:  # fmt: skip
    t, d, r = 5, 48, 16  # odd T, a dim that is not a power of two (masked), rope the last 16
    shape = (t, heads, d) if heads else (t, d)
    x = (torch.randn(shape, generator=gen) * 3).to(dtype)
    weight = torch.randn(d, generator=gen).to(dtype) if norm == "weighted" else None
    eps = 1e-6 if norm else None
    cos = sin = None
    if rope:  # cos/sin in the model's dtype, as the layers pass them
        freqs = torch.rand(t, r // 2, generator=gen) * 50
        cos, sin = freqs.cos().to(dtype), freqs.sin().to(dtype)
    ref = _ref(x, weight, eps, cos, sin, inverse)
    mv = lambda v: None if v is None else v.to(device)  # noqa: E731
    out = ops.norm_rope(mv(x), mv(weight), eps, mv(cos), mv(sin), inverse)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    out = out.cpu()
    if rope:  # the nope part moves untouched (normed as the reference)
        assert rel_err(out[..., : d - r], ref[..., : d - r]) < (
            1e-6 if dtype == torch.float32 else 1e-2
        )
    assert rel_err(out, ref) < (1e-6 if dtype == torch.float32 else 1e-2)
    # value by value, a few rounding steps of the dtype at the row's scale apart (the
    # interpreter truncates float32 to bfloat16 where the GPU rounds to nearest)
    scale = ref.float().abs().amax(-1, keepdim=True)
    assert ((out.float() - ref.float()).abs() <= 4 * torch.finfo(dtype).eps * scale).all()


def test_norm_rope_reads_strided_rows(ops, device: str, gen: torch.Generator) -> None:  # type: ignore[no-untyped-def]
    """A view whose rows are strided (a slice of a wider projection) is read as it lies."""
    wide = torch.randn(4, 2, 80, generator=gen)
    x = wide[..., 16:64]  # [4, 2, 48], row stride 80
    freqs = torch.rand(4, 8, generator=gen) * 9
    ref = _ref(x, None, 1e-6, freqs.cos(), freqs.sin(), False)
    out = ops.norm_rope(x.to(device), None, 1e-6, freqs.cos().to(device), freqs.sin().to(device))
    assert rel_err(out, ref) < 1e-6


def _cache(blocks: int, block: int, width: int, dtype: torch.dtype) -> torch.Tensor:
    fill = 0 if dtype == torch.uint8 else NAN  # NaN-poisoned: a missed or stray write shows
    return torch.full((blocks, 2, 1, 1, block, width), fill, dtype=dtype)[:, 1]


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("slot_dtype", [torch.int64, torch.int32], ids=["i64", "i32"])
def test_write_parts_matches_reference(  # type: ignore[no-untyped-def]
    ops, device: str, gen: torch.Generator, cache_dtype: torch.dtype, slot_dtype: torch.dtype
) -> None:
    t, widths, row = 5, (24, 7, 7, 13, 13), 70  # 64 values, 6 of padding
    parts = [torch.randn(t, w, generator=gen).to(cache_dtype) for w in widths]
    parts[3] = torch.randn(t, 2 * widths[3], generator=gen).to(cache_dtype)[:, ::2]  # strided
    if cache_dtype == torch.float32:  # a piece of another dtype is cast (exactly, upwards)
        parts[1] = parts[1].to(torch.bfloat16)
    slots = torch.tensor([[9, -1, 30, 2, 17]] * 2, dtype=slot_dtype).t()[:, 0]  # strided
    cache = _cache(8, 4, row, cache_dtype)
    ref = cache.clone()
    v4_ops.write_rows(ref, torch.nn.functional.pad(torch.cat([p.float() for p in parts], -1),
                                                   (0, row - 64)).to(cache_dtype), slots.long())  # fmt: skip
    got = cache.to(device)
    ops.write_parts(got, [p.to(device) for p in parts], slots.to(device))
    assert torch.equal(got.cpu().nan_to_num(-7), ref.nan_to_num(-7))


def test_write_parts_torch_path_equals_kernel(ops, device: str, gen: torch.Generator) -> None:  # type: ignore[no-untyped-def]
    """v4_ops.write_parts' torch path (the CPU one) writes what the kernel writes."""
    parts = [torch.randn(3, w, generator=gen) for w in (16, 8)]
    slots = torch.tensor([3, 0, -1])
    want, got = _cache(2, 4, 30, torch.float32), _cache(2, 4, 30, torch.float32).to(device)
    row = torch.nn.functional.pad(torch.cat(parts, -1), (0, 6))
    v4_ops.write_rows(want, row, slots)
    ops.write_parts(got, [p.to(device) for p in parts], slots.to(device))
    assert torch.equal(got.cpu().nan_to_num(-7), want.nan_to_num(-7))


@pytest.mark.parametrize("with_rows", [False, True], ids=["own", "rows"])
@pytest.mark.parametrize("int32", [False, True], ids=["i64", "i32"])
def test_slots_of_matches_reference(  # type: ignore[no-untyped-def]
    ops, device: str, gen: torch.Generator, with_rows: bool, int32: bool
) -> None:
    size, width = 4, 5
    tables = torch.randint(0, 50, (3, width), generator=gen)
    tables[1, 3:] = -1  # unallocated blocks
    pos = torch.randint(-3, size * width + 6, (4, 37), generator=gen)  # some out of the table
    rows = torch.tensor([[2, 9], [0, 9], [1, 9], [1, 9]])[:, 0] if with_rows else None  # strided
    if not with_rows:
        tables = torch.cat((tables, tables[:1]))  # a table a row
    ref = v4_ops.slots_of_ref(tables if rows is None else tables[rows], pos, size)
    dt = torch.int32 if int32 else torch.long
    mv = lambda v: None if v is None else v.to(dt).to(device)  # noqa: E731
    out = ops.slots_of(mv(tables), mv(pos), size, mv(rows))
    assert out.dtype == torch.long and torch.equal(out.cpu(), ref)
    assert (ref == -1).any() and (ref >= 0).any()
    empty = ops.slots_of(mv(tables[:, :0]), mv(pos), size, mv(rows))
    assert (empty == -1).all()


def test_unsupported_cases_are_named(ops) -> None:  # type: ignore[no-untyped-def]
    assert ops.unsupported("norm_rope", torch.zeros(2, 4, dtype=torch.float64)) is not None
    assert ops.unsupported("write_parts", *[torch.zeros(1)] * 8) is not None
    assert ops.unsupported("nothing", torch.zeros(1)) is not None
    assert ops.unsupported("norm_rope", torch.zeros(2, 4)) is None


def test_top_lowest_ties_orders_signed_floats_and_zeros(gen: torch.Generator) -> None:
    """The indexer's selection (kernels/triton_indexer.py, one int64 topk): negative and
    fractional scores, -0.0 equal to +0.0, huge magnitudes, -inf never picked: the first k
    of a full (score descending, index ascending) sort."""
    pytest.importorskip("triton")
    from pdserve.kernels.triton_indexer import top_lowest_ties

    pool = torch.tensor([-0.0, 0.0, 0.5, -0.5, -1.25, 3e38, -3e38, 1e-40, -1e-40, 7.0])
    for _ in range(30):
        width = int(torch.randint(1, 40, (1,), generator=gen))
        k = int(torch.randint(1, 50, (1,), generator=gen))
        scores = pool[torch.randint(0, len(pool), (4, width), generator=gen)]
        scores[torch.rand(4, width, generator=gen) < 0.2] = float("-inf")
        got = top_lowest_ties(scores, k)
        for r in range(4):
            keys = sorted((-scores[r, i].item(), i) for i in range(width) if scores[r, i] > -1e39)
            want = [i for _, i in keys[:k]]
            assert got[r].tolist() == want + [-1] * (k - len(want))


@pytest.mark.parametrize("kind", ["v4_bf16", "v4_fp8"])
def test_score_keys_select_as_the_scores(device: str, gen: torch.Generator, kind: str) -> None:
    """The scores kernel's int64 keys (index_scores(keys=True), what indexer_topk ranks)
    pick what top_lowest_ties picks over its float scores, -inf tiles included."""
    from pdserve.kernels import triton_indexer
    from tests.test_kernels_dsa import Case

    case = Case(kind, [5, 37, 70], [5, 3, 1], gen, device)
    scores = triton_indexer.index_scores(*case.args())
    keys = triton_indexer.index_scores(*case.args(), keys=True)
    assert keys.dtype == torch.int64 and keys.shape == scores.shape
    for k in (4, 8, scores.shape[1] + 3):
        want = triton_indexer.top_lowest_ties(scores.cpu(), k)
        assert torch.equal(triton_indexer.top_of_keys(keys, k).cpu(), want)


@pytest.mark.parametrize("overlap", [True, False], ids=["csa", "hca"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_compress_rotates_its_entries_in_the_kernel(  # type: ignore[no-untyped-def]
    device: str, gen: torch.Generator, overlap: bool, dtype: torch.dtype, monkeypatch
) -> None:
    """kernels/triton_v4.compress with cos/sin: the pooled, normed entry then rope_ref's
    rotation of its trailing values (what Compressor.entries asked of two calls)."""
    from pdserve.kernels import triton_v4, v4_reference
    from tests.test_kernels_v4 import _filled

    if device == "cpu":
        fix_interpreter_index(monkeypatch)
    d, m, block, r = 24, 4, 8, 8  # the rope over the last 8 of 24 (a dim not a power of two)
    width, span, offset = (2 * d if overlap else d), (2 * m if overlap else m), 32
    rows, rslots, _ = _filled(gen, max(60, 5 * span), block, offset + 2 * width, dtype)
    slots = rslots[: 5 * span].reshape(5, span).clone()
    slots[0, : m if overlap else 1] = -1
    ape = torch.randn(m, width, generator=gen).to(dtype)
    weight = torch.randn(d, generator=gen).to(dtype)
    freqs = torch.rand(5, r // 2, generator=gen) * 30
    cos, sin = freqs.cos(), freqs.sin()  # float32, as V4Step.entry_rope gives them
    pooled = v4_reference.compress(rows, slots, offset, ape, weight, 1e-6, overlap, dtype)
    ref = v4_ops.rope_ref(pooled, cos, sin)
    mv = lambda v: v.to(device)  # noqa: E731
    out = triton_v4.compress(
        mv(rows), mv(slots), offset, mv(ape), mv(weight), 1e-6, overlap, dtype, None,
        (mv(cos), mv(sin)),
    )  # fmt: skip
    assert rel_err(out, ref) < (1e-5 if dtype == torch.float32 else 2e-2)
    plain = triton_v4.compress(
        mv(rows), mv(slots), offset, mv(ape), mv(weight), 1e-6, overlap, dtype
    )
    assert torch.equal(out.cpu()[:, : d - r], plain.cpu()[:, : d - r])  # the nope part as is
    assert rel_err(out.cpu()[:, d - r :], plain.cpu()[:, d - r :]) > 0.1  # rotated
