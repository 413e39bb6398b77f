"""DeepSeek-V4's paged ops (kernels/v4_ops.py): the batched torch reference against the
per-sequence maths it replaced (written out here, one window and one query at a time), and
each Triton kernel (kernels/triton_v4.py) against the reference, on the GPU (``gpu``) and
on CPU through Triton's interpreter (``interp``: ``TRITON_INTERPRET=1 pytest
tests/test_kernels_v4.py -m interp``), auto and fp8 (kernels/fp8_ds_v4.py) caches.

Caches are one layer's strided view ``[N, 1, 1, B, row]`` of a NaN-poisoned
``[N, L, 1, 1, B, row]``; slots are shuffled, some negative (nothing there).
"""

from __future__ import annotations

import pytest
import torch

from pdserve.kernels import fp8_ds_v4, v4_reference
from pdserve.kernels.v4_reference import Fp8Rows
from tests.kernel_tools import (  # noqa: F401 (the *_fixture: fixtures device, gen)
    INTERPRET,
    device_fixture,
    fix_interpreter_index,
    gen_fixture,
    rel_err,
    triton_module,
)

NAN = float("nan")
LAYERS, LAYER = 2, 1


@pytest.fixture
def ops(device: str, monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    return triton_module("triton_v4", device, monkeypatch)


def _cache(num_blocks: int, block: int, width: int, dtype: torch.dtype) -> torch.Tensor:
    fill = 0 if dtype == torch.uint8 else NAN
    return torch.full((num_blocks, LAYERS, 1, 1, block, width), fill, dtype=dtype)[:, LAYER]


def _filled(
    gen: torch.Generator, n: int, block: int, width: int, dtype: torch.dtype,
    fp8: Fp8Rows | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """A cache of ``n`` random rows at shuffled slots: (cache, slots [n], rows [n, width])."""
    num_blocks = n // block + 3
    slots = torch.randperm(num_blocks * block, generator=gen)[:n]
    values = torch.randn(n, width, generator=gen).to(dtype)  # fp8: the model dtype
    if fp8 is None:
        cache = _cache(num_blocks, block, width, dtype)
        rows = values
    else:
        cols = fp8.head_dim
        bytes_ = fp8_ds_v4.kv_bytes(fp8.head_dim, fp8.rope_dim) + 4 * (width - cols) + 3
        rows = fp8_ds_v4.pack_rows(values, fp8.head_dim, fp8.rope_dim, bytes_)
        cache = _cache(num_blocks, block, bytes_, torch.uint8)
    v4_reference.write_rows(cache, rows, slots)
    return cache, slots, rows


def _masked(slots: torch.Tensor, gen: torch.Generator, frac: float = 0.25) -> torch.Tensor:
    drop = torch.rand(slots.shape, generator=gen) < frac
    return torch.where(drop, -1, slots)


# -- the batched reference against the per-sequence maths it replaced -----------------------


def _naive_attention(q, rows, win, entries, ent, sinks, scale, d):  # type: ignore[no-untyped-def]
    """One query at a time: its visible K=V rows, logits, the sink appended, softmax."""
    size = rows.shape[3]
    out = torch.zeros(q.shape, dtype=torch.float64)
    for t in range(q.shape[0]):
        keys = [rows[s // size, 0, 0, s % size, :d] for s in win[t].tolist() if s >= 0]
        if entries is not None:
            esize = entries.shape[3]
            keys += [entries[s // esize, 0, 0, s % esize, :d] for s in ent[t].tolist() if s >= 0]
        kv = torch.stack(keys).double()
        logits = q[t].double() @ kv.t() * scale  # [H, K]
        logits = torch.cat((logits, sinks.double()[:, None]), dim=-1)
        out[t] = logits.softmax(-1)[:, :-1] @ kv
    return out


def test_reference_attention_equals_one_query_at_a_time(gen: torch.Generator) -> None:
    d, heads, block = 32, 4, 8
    rows, rslots, _ = _filled(gen, 40, block, d + 8, torch.float32)
    entries, eslots, _ = _filled(gen, 30, block, d, torch.float32)
    t = 6
    win = _masked(rslots[torch.randint(0, 40, (t, 9), generator=gen)], gen)
    win[:, -1] = rslots[:t]  # every query sees at least one row
    ent = _masked(eslots[torch.randint(0, 30, (t, 11), generator=gen)], gen, 0.5)
    q = torch.randn(t, heads, d, generator=gen)
    sinks = torch.randn(heads, generator=gen)
    out = v4_reference.sink_attention(q, rows, win, entries, ent, sinks, d**-0.5)
    ref = _naive_attention(q, rows, win, entries, ent, sinks, d**-0.5, d)
    assert rel_err(out, ref) < 1e-5
    # without entries too (sliding layers)
    out = v4_reference.sink_attention(q, rows, win, None, None, sinks, d**-0.5)
    assert rel_err(out, _naive_attention(q, rows, win, None, None, sinks, d**-0.5, d)) < 1e-5


def _naive_entry(rows, slots, offset, ape, weight, eps, overlap):  # type: ignore[no-untyped-def]
    """One window: its 2m (m) rows' kv and gate series, softmax over the window, RMSNorm."""
    m, width = ape.shape
    d = weight.shape[0]
    size = rows.shape[3]
    kvs, gates = [], []
    for j, s in enumerate(slots.tolist()):
        if s < 0:
            continue
        row = rows[s // size, 0, 0, s % size].double()
        kv, gate = row[offset : offset + width], row[offset + width : offset + 2 * width]
        if overlap:
            half = slice(0, d) if j < m else slice(d, 2 * d)
            kvs.append(kv[half])
            gates.append(gate[half] + ape[j % m, half].double())
        else:
            kvs.append(kv)
            gates.append(gate + ape[j].double())
    pooled = (torch.stack(kvs) * torch.stack(gates).softmax(0)).sum(0)
    return weight.double() * pooled * torch.rsqrt(pooled.square().mean() + eps)


@pytest.mark.parametrize("overlap", [True, False], ids=["csa", "hca"])
def test_reference_compress_equals_one_window_at_a_time(
    gen: torch.Generator, overlap: bool
) -> None:
    d, m, block = 16, 4, 8
    width = 2 * d if overlap else d
    offset = 24
    rows, rslots, _ = _filled(gen, 48, block, offset + 2 * width, torch.float32)
    span = 2 * m if overlap else m
    slots = rslots[: 4 * span].reshape(4, span).clone()
    if overlap:
        slots[0, :m] = -1  # window 0: no window before it
    ape = torch.randn(m, width, generator=gen)
    weight = torch.randn(d, generator=gen)
    out = v4_reference.compress(rows, slots, offset, ape, weight, 1e-6, overlap, torch.float32)
    for p in range(4):
        ref = _naive_entry(rows, slots[p], offset, ape, weight, 1e-6, overlap)
        assert rel_err(out[p], ref) < 1e-5


# -- Triton against the reference -----------------------------------------------------------


def test_write_rows_matches_reference(ops, device: str, gen: torch.Generator) -> None:  # type: ignore[no-untyped-def]
    for dtype, width in ((torch.float32, 40), (torch.uint8, 77)):
        cache, _, _ = _filled(gen, 8, 4, width, dtype)
        slots = torch.tensor([5, -1, 17, 2, -1, 19], dtype=torch.long)
        rows = (torch.rand(6, width, generator=gen) * 100).to(dtype)
        ref = cache.clone()
        v4_reference.write_rows(ref, rows, slots)
        got = cache.to(device)
        ops.write_rows(got, rows.to(device), slots.to(device))
        assert torch.equal(got.cpu().nan_to_num(-7), ref.nan_to_num(-7))


@pytest.mark.parametrize("overlap", [True, False], ids=["csa", "hca"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("size", ["small", "flash"])
def test_compress_matches_reference(  # type: ignore[no-untyped-def]
    ops, device: str, gen: torch.Generator, overlap: bool, dtype: torch.dtype, size: str
) -> None:
    d, m, block = 24, 4, 8  # a dim that is not a power of two: the kernel masks it
    if size == "flash":  # V4-Flash: head_dim 512, CSA windows of 4, HCA of 128 (GPU only)
        if device == "cpu":
            pytest.skip("too big for Triton's interpreter")
        d, m, block = 512, 4 if overlap else 128, 64
    width = 2 * d if overlap else d
    offset = 32
    span = 2 * m if overlap else m
    rows, rslots, _ = _filled(gen, max(60, 5 * span), block, offset + 2 * width, dtype)
    slots = rslots[: 5 * span].reshape(5, span).clone()
    slots[0, : m if overlap else 1] = -1
    ape = torch.randn(m, width, generator=gen).to(dtype)
    weight = torch.randn(d, generator=gen).to(dtype)
    ref = v4_reference.compress(rows, slots, offset, ape, weight, 1e-6, overlap, dtype)
    out = ops.compress(
        rows.to(device), slots.to(device), offset, ape.to(device), weight.to(device), 1e-6,
        overlap, dtype,
    )  # fmt: skip
    assert rel_err(out, ref) < (1e-5 if dtype == torch.float32 else 2e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_compress_reads_fp8_rows_state_in_place(  # type: ignore[no-untyped-def]
    ops, device: str, gen: torch.Generator, dtype: torch.dtype
) -> None:
    """The state after the 194-byte K=V record: float32 values at no 4-byte boundary."""
    fp8 = Fp8Rows(head_dim=128, rope_dim=64)
    d, m, block = 16, 4, 4
    width = 2 * d
    rows, rslots, _ = _filled(gen, 24, block, fp8.head_dim + 2 * width, dtype, fp8)
    slots = rslots[:16].reshape(2, 8)
    ape = torch.randn(m, width, generator=gen).to(dtype)
    weight = torch.randn(d, generator=gen).to(dtype)
    args = (fp8.head_dim, ape, weight, 1e-6, True, dtype, fp8)
    ref = v4_reference.compress(rows, slots, *args)
    dev = tuple(a.to(device) if torch.is_tensor(a) else a for a in args)
    out = ops.compress(rows.to(device), slots.to(device), *dev)
    assert rel_err(out, ref) < (1e-5 if dtype == torch.float32 else 2e-2)


CASES = {  # (queries, heads, head_dim, window, entries)
    "sliding": (5, 4, 32, 9, 0),
    "entries": (4, 4, 32, 8, 21),
    "heads20": (3, 20, 16, 5, 7),  # heads over two programs, masked
    "flash": (6, 64, 512, 128, 512),  # V4-Flash's heads (a TP 1 rank), window and top-k: GPU
}
GPU_ONLY = {"flash"}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_sink_attention_matches_reference(  # type: ignore[no-untyped-def]
    ops, device: str, gen: torch.Generator, case: str, dtype: torch.dtype
) -> None:
    if case in GPU_ONLY and device == "cpu":
        pytest.skip("too big for Triton's interpreter")
    t, heads, d, w, e = CASES[case]
    n = max(50, w + 10)
    rows, rslots, _ = _filled(gen, n, 8, d + 8, dtype)
    win = _masked(rslots[torch.randint(0, n, (t, w), generator=gen)], gen)
    entries, ent = None, None
    if e:
        entries, eslots, _ = _filled(gen, 40 + e, 4, d, dtype)
        ent = _masked(eslots[torch.randint(0, 40 + e, (t, e), generator=gen)], gen, 0.4)
        ent[0] = -1  # a query that sees no entry
    win[-1] = -1  # and one that sees only its sink: output 0
    q = torch.randn(t, heads, d, generator=gen).to(dtype)
    sinks = torch.randn(heads, generator=gen)
    ref = v4_reference.sink_attention(q, rows, win, entries, ent, sinks, d**-0.5)

    def dev(x):  # type: ignore[no-untyped-def]
        return None if x is None else x.to(device)

    out = ops.sink_attention(dev(q), dev(rows), dev(win), dev(entries), dev(ent), dev(sinks),
                             d**-0.5)  # fmt: skip
    assert out.dtype == dtype
    assert rel_err(out, ref) < (1e-5 if dtype == torch.float32 else 2e-2)


def test_sink_attention_dequantizes_fp8_rows_in_the_kernel(  # type: ignore[no-untyped-def]
    ops, device: str, gen: torch.Generator
) -> None:
    fp8 = Fp8Rows(head_dim=128, rope_dim=64, index_dim=0)
    d, t, heads = 128, 3, 4
    rows, rslots, _ = _filled(gen, 20, 4, d + 8, torch.float32, fp8)
    entries, eslots, _ = _filled(gen, 12, 4, d, torch.float32, fp8)
    win = _masked(rslots[torch.randint(0, 20, (t, 6), generator=gen)], gen)
    ent = _masked(eslots[torch.randint(0, 12, (t, 5), generator=gen)], gen)
    q = torch.randn(t, heads, d, generator=gen)
    sinks = torch.randn(heads, generator=gen)
    ref = v4_reference.sink_attention(q, rows, win, entries, ent, sinks, d**-0.5, fp8)
    out = ops.sink_attention(
        q.to(device), rows.to(device), win.to(device), entries.to(device), ent.to(device),
        sinks.to(device), d**-0.5, fp8,
    )  # fmt: skip
    assert rel_err(out, ref) < 1e-5


def test_unsupported_cases_are_named(ops) -> None:  # type: ignore[no-untyped-def]
    q = torch.zeros(1, 2, 24)
    reason = ops.unsupported("sink_attention", q, q)
    assert reason is not None and "head_dim 24" in reason
    assert ops.unsupported("no_such_op", q) == "no_such_op: no Triton kernel"


@pytest.mark.interp
@pytest.mark.skipif(not INTERPRET, reason="set TRITON_INTERPRET=1 to interpret on CPU")
def test_v4_engine_through_the_triton_kernels_equals_transformers(tmp_path, model_dir, monkeypatch):  # type: ignore[no-untyped-def]
    """The whole V4 model (sliding, CSA, HCA layers) on the Triton path (PDSERVE_KERNELS=
    triton under the interpreter): two prompts batched, 50-token chunks across 16-token
    blocks (neither a multiple of 4 nor of 16), decode steps (the device-only path): HF's
    tokens."""
    pytest.importorskip("transformers")
    from pdserve.common.model.fixtures.random import save_random_v4
    from tests.kernel_tools import triton_engine_greedy_equals_hf

    fix_interpreter_index(monkeypatch)
    model = save_random_v4(tmp_path / "v4", tokenizer_from=model_dir)
    triton_engine_greedy_equals_hf(model, model_dir, monkeypatch)


def test_v4_decode_steps_need_no_host_spans(tmp_path, model_dir, monkeypatch):  # type: ignore[no-untyped-def]
    """A decode-only step is what a CUDA graph replays, whose metadata has no
    ``seq_spans`` / ``seq_block_tables`` (common/engine/cuda_graphs.py): with both dropped
    from every decode-only step, the closing windows come from the device alone
    (dsv4_attention.V4Step) and the tokens are still HF's (CPU, the torch reference)."""
    pytest.importorskip("transformers")
    import dataclasses

    from pdserve.common.engine import group_meta
    from pdserve.common.engine.config import EngineConfig
    from pdserve.common.engine.llm_engine import LLMEngine
    from pdserve.common.engine.sampling import SamplingParams
    from pdserve.common.model.fixtures.random import save_random_v4
    from tests.test_families import hf_greedy, sentence_prompts

    with_seqs = group_meta._with_seqs
    stripped = []

    def without_spans(metas, plan, rates):  # type: ignore[no-untyped-def]
        out = with_seqs(metas, plan, rates)
        if plan.seqs and all(len(s.token_ids) == 1 for s in plan.seqs):
            stripped.append(len(plan.seqs))
            return [dataclasses.replace(m, seq_spans=(), seq_block_tables=None) for m in out]
        return out

    monkeypatch.setattr(group_meta, "_with_seqs", without_spans)
    model = save_random_v4(tmp_path / "v4", tokenizer_from=model_dir)
    prompts = sentence_prompts(model_dir, (40, 70), 20)
    reference = hf_greedy(model, prompts, 12)  # decodes across CSA (4) and HCA (16) closes
    engine = LLMEngine(EngineConfig(model=str(model), kv_cache_memory_gb=0.05, block_size=16))
    got = engine.generate(prompts, SamplingParams(max_tokens=12))
    assert [o.token_ids for o in got] == reference
    assert stripped and max(stripped) == 2  # both sequences decoded in stripped steps
