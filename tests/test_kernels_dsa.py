"""The lightning indexer's top-k (kernels.indexer_topk) and V3.2's sparse MLA: the torch
references against the formula, the Triton kernels against the references (``interp``:
TRITON_INTERPRET=1 on CPU; ``cuda``: the GPU), for every key format (V3.2's bf16 and fp8
rows, V4's compressed entries, auto and fp8), top-k below the visible keys and above."""

from __future__ import annotations

import math

import pytest
import torch

from pdserve.kernels import KeyFormat, fp8_ds_mla, fp8_ds_v4, indexer_ref
from tests.kernel_tools import INTERPRET, device_fixture, gen_fixture  # noqa: F401

BLOCK = 16
HEADS, DIM = 4, 128
LATENT, ROPE = 128, 16  # V3.2's row (fp8: kv_lora_rank a multiple of 128)
V4_HEAD, V4_ROPE = 256, 64  # V4's entry: its fp8 record is 324 bytes, the key at an odd place


def key_rows(kind: str, keys: torch.Tensor, gen: torch.Generator) -> tuple[torch.Tensor, KeyFormat]:
    """[n, row] rows of ``kind`` holding ``keys`` [n, DIM] after random other parts."""
    n = keys.shape[0]
    if kind.startswith("v32"):
        latent = torch.randn(n, LATENT, generator=gen)
        rope = torch.randn(n, ROPE, generator=gen)
        if kind == "v32_fp8":
            rows = fp8_ds_mla.quantize_indexed(latent, rope, keys)
            return rows, KeyFormat.v32(LATENT, ROPE, DIM, fp8=True)
        dtype = torch.bfloat16 if kind == "v32_bf16" else torch.float32
        rows = torch.cat((latent, rope, keys), dim=-1).to(dtype)
        return rows, KeyFormat.v32(LATENT, ROPE, DIM, fp8=False)
    kv = torch.randn(n, V4_HEAD, generator=gen)
    entries = torch.cat((kv, keys), dim=-1)
    if kind == "v4_fp8":
        width = fp8_ds_v4.kv_bytes(V4_HEAD, V4_ROPE) + fp8_ds_mla.key_bytes(DIM) + 3
        rows = fp8_ds_v4.pack_entries(entries, V4_HEAD, V4_ROPE, width)
        return rows, KeyFormat.v4_entry(V4_HEAD, V4_ROPE, DIM, fp8=True)
    return entries.to(torch.bfloat16), KeyFormat.v4_entry(V4_HEAD, V4_ROPE, DIM, fp8=False)


KINDS = ["v32_fp32", "v32_bf16", "v32_fp8", "v4_bf16", "v4_fp8"]


class Case:
    """Sequences of random keys in a paged cache (shuffled blocks, the rest NaN or random
    bytes), a query run at the end of each, as a prefill (or a decode: one query) has."""

    def __init__(self, kind, ctx_lens, q_lens, gen, device):
        blocks = [math.ceil(c / BLOCK) for c in ctx_lens]
        num_blocks = sum(blocks) + 3
        ids = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
        self.block_tables = torch.zeros(len(ctx_lens), max(blocks) + 1, dtype=torch.int32)
        for s, n in enumerate(blocks):
            self.block_tables[s, :n] = torch.tensor(ids[:n])
            del ids[:n]
        total = sum(ctx_lens)
        self.keys = torch.randn(total, DIM, generator=gen)
        rows, self.fmt = key_rows(kind, self.keys, gen)
        if self.fmt.fp8:  # the keys as the cache returns them
            self.keys = self.fmt.decode(rows)
        elif rows.dtype == torch.bfloat16:
            self.keys = self.keys.bfloat16().float()
        cache = torch.full((num_blocks, BLOCK, rows.shape[1]), float("nan"))
        if rows.dtype == torch.uint8:
            cache = torch.randint(0, 256, cache.shape, generator=gen, dtype=torch.uint8)
        cache = cache.to(rows.dtype)
        at = 0
        for s, c in enumerate(ctx_lens):
            pos = torch.arange(c)
            cache[self.block_tables[s, pos // BLOCK].long(), pos % BLOCK] = rows[at : at + c]
            at += c
        self.starts = [sum(ctx_lens[:s]) for s in range(len(ctx_lens))]
        self.ctx_lens = ctx_lens
        seq, vis = [], []
        for s, (c, n) in enumerate(zip(ctx_lens, q_lens, strict=True)):
            seq += [s] * n
            vis += list(range(c - n + 1, c + 1))
        self.query_seq = torch.tensor(seq, dtype=torch.int32)
        self.num_visible = torch.tensor(vis, dtype=torch.int32)
        num_q = len(seq)
        self.q = torch.randn(num_q, HEADS, DIM, generator=gen)
        self.weights = torch.randn(num_q, HEADS, generator=gen)
        self.cache = cache
        self.device = device

    def args(self, device=None):
        device = device or self.device
        return (
            self.q.to(device),
            self.weights.to(device),
            self.cache.to(device),
            self.fmt,
            self.block_tables.to(device),
            self.query_seq.to(device),
            self.num_visible.to(device),
        )

    def scores(self) -> torch.Tensor:  # [T, L] float64 by the formula, one query at a time
        num_keys = max(self.ctx_lens)
        out = torch.full((len(self.query_seq), num_keys), float("-inf"), dtype=torch.float64)
        for t, (s, n) in enumerate(
            zip(self.query_seq.tolist(), self.num_visible.tolist(), strict=True)
        ):
            keys = self.keys[self.starts[s] : self.starts[s] + n].double()
            dots = self.q[t].double() @ keys.t()  # [H, n]
            out[t, :n] = (self.weights[t, :, None].double() * dots.relu()).sum(0) / DIM**0.5
        return out


def check_selection(case: Case, ids: torch.Tensor, topk: int) -> None:
    """Each query picked ``min(topk, visible)`` distinct visible keys whose scores are the
    best ones (to rounding: near-equal scores may swap), -1 after them."""
    ids = ids.cpu().long()
    assert ids.shape == (len(case.query_seq), topk)
    scores = case.scores()
    for t, n in enumerate(case.num_visible.tolist()):
        want = min(topk, n)
        got = ids[t, :want]
        assert (ids[t, want:] == -1).all(), (t, ids[t])
        assert (got >= 0).all() and (got < n).all() and got.unique().numel() == want, (t, got)
        best = scores[t].sort(descending=True).values[:want]
        mine = scores[t, got].sort(descending=True).values
        torch.testing.assert_close(mine, best, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("topk", [8, 64])
def test_indexer_reference(kind, topk, gen):
    """The reference against the formula: one sequence (prefill from 0) and three (runs at
    their ends, one a decode), top-k below and above the visible keys."""
    for ctx_lens, q_lens in (([40], [40]), ([5, 37, 70], [5, 3, 1])):
        case = Case(kind, ctx_lens, q_lens, gen, "cpu")
        check_selection(case, indexer_ref.indexer_topk(*case.args(), topk), topk)


def test_indexer_reference_orders_by_score(gen):
    case = Case("v32_fp32", [50], [2], gen, "cpu")
    ids = indexer_ref.indexer_topk(*case.args(), 10).long()
    scores = case.scores()
    for t in range(2):
        picked = scores[t, ids[t]]
        assert (picked[:-1] >= picked[1:]).all()


def test_key_format_refuses_mismatch():
    fmt = KeyFormat.v32(LATENT, ROPE, DIM, fp8=True)
    with pytest.raises(ValueError, match="does not read"):
        fmt.check(torch.zeros(2, BLOCK, 400))
    with pytest.raises(ValueError, match="overruns"):
        fmt.check(torch.zeros(2, BLOCK, 200, dtype=torch.uint8))


@pytest.mark.parametrize("kind", KINDS)
def test_indexer_triton(device, kind, gen):
    """The Triton kernel selects as the reference: top-k 8 below the visible keys (and
    above them for the short sequence's first queries)."""
    from pdserve.kernels import triton_indexer

    case = Case(kind, [5, 37, 70], [5, 3, 1], gen, device)
    ids = triton_indexer.indexer_topk(*case.args(), 8)
    assert ids.device.type == torch.device(device).type
    check_selection(case, ids, 8)
    ref = indexer_ref.indexer_topk(*case.args("cpu"), 8)
    assert ((ids.cpu() == -1) == (ref == -1)).all()


def test_indexer_triton_chunks_queries(device, gen, monkeypatch):
    """Queries in chunks (a long prefill's bounded score buffer) select as in one go."""
    from pdserve.kernels import triton_indexer

    case = Case("v32_fp32", [40], [40], gen, device)
    whole = triton_indexer.indexer_topk(*case.args(), 8)
    monkeypatch.setattr(triton_indexer, "SCORE_BUDGET", 7 * 64)  # 7 queries a chunk
    assert torch.equal(triton_indexer.indexer_topk(*case.args(), 8), whole)


MLA_HEADS = 4


class SparseCase:
    """V3.2 rows (auto or fp8) of sequences in a paged cache, absorbed queries at the ends
    of the sequences, and a random selection of each query's visible rows (-1 padded)."""

    def __init__(self, kind, ctx_lens, q_lens, topk, gen, device):
        self.case = Case(kind, ctx_lens, q_lens, gen, device)
        self.fp8 = self.case.cache.dtype == torch.uint8
        num_q = len(self.case.query_seq)
        self.q = torch.randn(num_q, MLA_HEADS, LATENT + ROPE, generator=gen)
        picks = []
        for n in self.case.num_visible.tolist():
            chosen = torch.randperm(n, generator=gen)[:topk]
            picks.append(torch.cat((chosen, torch.full((topk - chosen.numel(),), -1))))
        self.indices = torch.stack(picks).int()

    def args(self, device=None):
        c = self.case
        device = device or c.device
        return (
            self.q.to(device),
            c.cache.to(device),
            LATENT,
            c.block_tables.to(device),
            c.query_seq.to(device),
            self.indices.to(device),
            0.3,
        )

    def expected(self) -> torch.Tensor:  # [T, H, latent] float64, one query at a time
        c = self.case
        out = torch.zeros(len(c.query_seq), MLA_HEADS, LATENT, dtype=torch.float64)
        size = c.cache.shape[1]
        for t, s in enumerate(c.query_seq.tolist()):
            pos = self.indices[t][self.indices[t] >= 0].long()
            raw = c.cache[c.block_tables[s, pos // size].long(), pos % size]
            if self.fp8:
                raw = fp8_ds_mla.dequantize_rows(raw[:, : fp8_ds_mla.record_bytes(LATENT, ROPE)],
                                                 LATENT)  # fmt: skip
            rows = raw[:, : LATENT + ROPE].double()
            if len(pos):
                probs = torch.softmax(self.q[t].double() @ rows.t() * 0.3, dim=-1)
                out[t] = probs @ rows[:, :LATENT]
        return out


SPARSE_KINDS = ["v32_fp32", "v32_bf16", "v32_fp8"]


@pytest.mark.parametrize("kind", SPARSE_KINDS)
def test_sparse_mla_reference(kind, gen):
    from pdserve.kernels import sparse_mla_ref

    sc = SparseCase(kind, [5, 37, 70], [5, 3, 1], 8, gen, "cpu")
    if not sc.fp8:  # a NaN in the row a -1 stands in for (its sequence's first) is not read
        first = sc.case.block_tables[0, 0].long()
        sc.case.cache[first, 0, :LATENT] = float("nan")
        mine = sc.indices[:5]  # sequence 0's queries: position 0 no longer selected
        mine[mine == 0] = -1
    out = sparse_mla_ref.sparse_mla_attention(*sc.args())
    assert not out.isnan().any()
    torch.testing.assert_close(out.double(), sc.expected(), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kind", SPARSE_KINDS)
def test_sparse_mla_triton(device, kind, gen):
    """Top-k 24: more than one BLOCK_N of rows, -1 pads for the short sequence's queries
    (its first query sees one row)."""
    from pdserve.kernels import sparse_mla_ref, triton_sparse_mla

    sc = SparseCase(kind, [5, 37, 70], [5, 3, 1], 24, gen, device)
    out = triton_sparse_mla.sparse_mla_attention(*sc.args())
    ref = sparse_mla_ref.sparse_mla_attention(*sc.args("cpu"))
    assert out.dtype == ref.dtype
    torch.testing.assert_close(out.cpu().double(), ref.double(), rtol=1e-4, atol=1e-4)
    none = sc.indices.clone()
    none[0] = -1  # a query with nothing selected: zeros
    sc.indices = none
    assert not triton_sparse_mla.sparse_mla_attention(*sc.args())[0].any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.uint8], ids=["fp32", "bytes"])
def test_write_rows_triton(device, dtype, gen):
    """Whole rows into their slots (a V3.2 fp8 row is its bytes), negative slots skipped."""
    from pdserve.kernels import sparse_mla_ref, triton_sparse_mla

    cache = torch.randint(0, 200, (6, BLOCK, 296), generator=gen).to(dtype)
    rows = torch.randint(0, 200, (5, 296), generator=gen).to(dtype)
    slots = torch.tensor([17, -1, 3, 95, -1])
    want = cache.clone()
    sparse_mla_ref.write_rows(want, rows, slots)
    got = cache.clone().to(device)
    triton_sparse_mla.write_rows(got, rows.to(device), slots.to(device))
    assert torch.equal(got.cpu(), want) and not torch.equal(want, cache)


@pytest.mark.interp
@pytest.mark.skipif(not INTERPRET, reason="set TRITON_INTERPRET=1 to interpret on CPU")
def test_v32_engine_through_the_triton_kernels_equals_transformers(
    tmp_path, model_dir, monkeypatch
):
    """The whole model on the Triton path (PDSERVE_KERNELS=triton under the interpreter):
    two prompts batched, 50-token chunks across 16-token blocks, decode steps: HF's tokens."""
    pytest.importorskip("transformers")
    from tests.kernel_tools import triton_engine_greedy_equals_hf
    from tests.test_dsa import build_v32

    model = build_v32(tmp_path / "v32", tokenizer_from=model_dir)
    triton_engine_greedy_equals_hf(model, model_dir, monkeypatch)


def test_top_lowest_ties_keeps_the_same_keys_at_any_width(gen):
    """The Triton path's selection over its score rows: the k best in descending score,
    equal scores by lower index, whatever -inf padding follows (a CUDA graph's wider tables,
    a PCP piece): the first k of a full (score descending, index ascending) sort."""
    pytest.importorskip("triton")
    from pdserve.kernels.triton_indexer import top_lowest_ties

    for _ in range(50):
        width = int(torch.randint(1, 60, (1,), generator=gen))
        k = int(torch.randint(1, 20, (1,), generator=gen))
        scores = torch.randint(-2, 4, (5, width), generator=gen).float()  # many ties
        visible = torch.randint(0, width + 1, (5,), generator=gen)
        scores[torch.arange(width)[None] >= visible[:, None]] = float("-inf")
        got = top_lowest_ties(scores, k)
        padded = torch.cat((scores, torch.full((5, 17), float("-inf"))), dim=1)
        assert torch.equal(top_lowest_ties(padded, k)[:, : min(k, width)], got[:, : min(k, width)])
        for r in range(5):
            keys = sorted((-scores[r, i].item(), i) for i in range(int(visible[r])))
            want = [i for _, i in keys[:k]]
            assert got[r].tolist() == want + [-1] * (k - len(want))
