"""DeepSeek-V4 attention on a paged cache: shared-KV MQA over a sliding window plus
compressed entries, rebuilt every step from the cache rows (torch; the CPU reference).

Parameter names are the checkpoint's (transformers converts them to its own on load):
``attn.wq_a`` -> ``attn.q_norm`` -> ``attn.wq_b`` (queries, then an unweighted RMSNorm per
head), ``attn.wkv`` -> ``attn.norm`` (the one K=V row), ``attn.attn_sink`` (a logit per head
that takes softmax mass and gives no value), ``attn.wo_a`` (block-diagonal over
``o_groups`` groups of heads) -> ``attn.wo_b``; ``attn.compressor.{wkv, wgate, ape, norm}``
and, CSA, ``attn.indexer.{wq_b, weights_proj}`` with ``attn.indexer.compressor.*``.

A compressed entry w pools the tokens of window w (``m`` tokens: 4 in CSA, 128 in HCA):
per channel, ``sum_j softmax_j(gate_j + ape_j) * kv_j``, normed, rotated at position
``w * m``. CSA pools two overlapping series: the entry of window w takes the first series
of window w - 1 and the second of window w (2m slots). A query at p sees the window
``p - W < k <= p`` and the entries ``w < (p + 1) // m`` (those whose window closed); in CSA
only the ``index_topk`` of them its lightning indexer scores highest.

State on the paged cache, as KV cache groups (common/engine/kv_groups.py cache_groups):
each token's row (its K=V row and the compressor's, and the indexer compressor's, per-token
kv and gate projections) in a sliding group whose window also covers what the compressors
still pool; the entries (K=V, and CSA's indexer key) in a compressed group, B entries a
block. A step writes its rows, pools the windows it closed into entries, and attends over
the window's rows and every closed entry. With ``--kv-cache-dtype fp8`` both are stored as
kernels/fp8_ds_v4.py lays them out (the K=V row and entry in vLLM's fp8 form, the indexer
key in fp8, the compressors' projections unquantized): quantized as written, dequantized
as read, so the arithmetic after a read is the auto cache's.

Tensor parallel (common/model/deepseek/dsv4_tp.py): a rank holds ``H / N`` query heads, their sinks
and their ``o_groups / N`` output groups; ``wo_b`` is row-parallel (all-reduced). The K=V
row, the compressors and the indexer are replicated: every rank writes the same cache.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.nn import functional as F

from pdserve import kernels
from pdserve.common.model.checkpoint.config import ModelConfig
from pdserve.common.model.deepseek.dsv4_config import CSA, SLIDING
from pdserve.common.model.layers.attention import AttentionMetadata
from pdserve.common.model.layers.linear import pack_linears
from pdserve.common.model.layers.rope import inv_frequencies
from pdserve.common.parallel.context import ParallelContext
from pdserve.kernels import fp8_ds_v4, v4_ops
from pdserve.kernels.indexer_ref import KeyFormat
from pdserve.kernels.v4_reference import Fp8Rows


def rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' DeepseekV4UnweightedRMSNorm (kernels: v4_ops.norm_rope)."""
    return v4_ops.norm_rope(x, None, eps)


class RMSNorm(nn.Module):
    """transformers' DeepseekV4RMSNorm (in float32, weight applied before the cast back;
    kernels: v4_ops.norm_rope)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return v4_ops.norm_rope(x, self.weight, self.eps)


class Rope:
    """V4's interleaved rope over the trailing ``rope_dim`` values of each head: cos/sin of
    one entry per pair (``rope_dim / 2``), yarn's attention factor left at 1 as
    transformers sets it for V4."""

    def __init__(self, rope_dim: int, theta: float, scaling: dict[str, object] | None) -> None:
        with torch.device("cpu"):
            self.inv_freq, _ = inv_frequencies(rope_dim, theta, scaling, 0)
        self._on: dict[torch.device, torch.Tensor] = {}  # a copy a device: no copy a step

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        inv = self._on.get(positions.device)
        if inv is None:
            inv = self._on[positions.device] = self.inv_freq.to(positions.device)
        freqs = positions.float()[:, None] * inv[None, :]
        return freqs.cos(), freqs.sin()  # [T, rope / 2]

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """``x`` [T, ..., D] with its last 2 * cos.shape[-1] values rotated at each row's
        position (cos/sin [T, rope / 2]), as transformers' apply_rotary_pos_emb
        (kernels: v4_ops.norm_rope)."""
        return v4_ops.norm_rope(x, None, None, cos, sin)


def slots_of(
    tables: torch.Tensor,  # [T, max_blocks] int64: each row's block table
    pos: torch.Tensor,  # [T, K] int64 positions; negative: none
    size: int,  # block size
) -> torch.Tensor:  # [T, K] int64 slots, -1 where there is none
    """Slots of positions through per-row block tables (no host sync; kernels:
    v4_ops.slots_of)."""
    return v4_ops.slots_of(tables, pos, size)


class V4Step:
    """A step's index metadata, built once for every layer (common/model/deepseek/dsv4.py): which
    sequence each query belongs to, its position, and, per KV cache group, its block table;
    the windows the step closes. Kept per (group, ...) so layers sharing a group share them.

    A step of decodes only (one token a sequence, a CUDA graph's kind) is all device work
    of static shapes: its sequence ``i`` is query ``i``, a candidate window per sequence
    (closing iff ``(p + 1) % m == 0``, else masked), entries bounded by the block tables'
    width. Other steps read the windows they close from the host's ``seq_spans``."""

    def __init__(self, meta: AttentionMetadata, positions: torch.Tensor) -> None:
        dev = positions.device
        num, nd = positions.shape[0], meta.num_decode_tokens
        self.positions = positions.long()
        rows = [torch.arange(nd, device=dev)]
        if num > nd:
            cu = meta.prefill_cu_seqlens_q.to(dev).long()
            at = torch.arange(num - nd, device=dev)
            rows.append(nd + torch.searchsorted(cu[1:].contiguous(), at, right=True))
        self.query_row = torch.cat(rows)  # [T]: row of cat(decode, prefill) block tables
        self.nd = nd
        self.decode_only = 0 < num == nd and meta.kv_gather is None
        self.spans = meta.seq_spans  # plan order, whole sequences (host)
        self._memo: dict[tuple[object, ...], torch.Tensor] = {}

    def _get(self, key: tuple[object, ...], make: Callable[[], torch.Tensor]) -> torch.Tensor:
        if key not in self._memo:
            self._memo[key] = make()
        return self._memo[key]

    def query_tables(self, meta: AttentionMetadata) -> torch.Tensor:  # [R, max_blocks] int
        """This group's block tables of the step's decode sequences then prefill pieces
        (``query_row`` indexes them); int64, or as the metadata holds them (int32) in a
        step of decodes only (no copy: v4_ops.slots_of and the indexer read either)."""

        def make() -> torch.Tensor:
            dec, pre = meta.decode_block_tables[: self.nd], meta.prefill_block_tables
            if self.decode_only:
                return dec.to(self.positions.device)
            width = max(dec.shape[1], pre.shape[1])
            dev = self.positions.device
            return torch.cat([F.pad(t.to(dev).long(), (0, width - t.shape[1])) for t in (dec, pre)])

        return self._get(("tables", id(meta)), make)

    def seq_tables(self, meta: AttentionMetadata) -> torch.Tensor:  # [S, max_blocks] int64
        """This group's block table of each sequence in ``closing``'s order."""
        if self.decode_only:
            return self.query_tables(meta)
        tables = meta.seq_block_tables
        assert tables is not None
        return self._get(("seq", id(meta)), lambda: tables.to(self.positions.device).long())

    def window_slots(self, meta: AttentionMetadata, size: int, window: int) -> torch.Tensor:
        """[T, W]: the slots of each query's window rows ``p - W < k <= p``."""

        def positions() -> torch.Tensor:  # [T, W], the same in every group
            offs = torch.arange(window - 1, -1, -1, device=self.positions.device)
            return self.positions[:, None] - offs[None, :]

        def make() -> torch.Tensor:
            pos = self._get(("window_pos", window), positions)
            return v4_ops.slots_of(self.query_tables(meta), pos, size, self.query_row)

        return self._get(("window", id(meta), size, window), make)

    def ends(self) -> torch.Tensor:  # [T] int64: each query's position + 1
        return self._get(("ends",), lambda: self.positions + 1)

    def closed(self, rate: int) -> torch.Tensor:  # [T] int64: entries each query may see
        return self._get(("closed", rate), lambda: self.ends() // rate)

    def win_starts(self, rate: int) -> torch.Tensor:  # [P]: the closing windows' first positions
        return self._get(("win_starts", rate), lambda: self.closing(rate)[1] * rate)

    def ranked(self, meta: AttentionMetadata, rate: int) -> torch.Tensor:  # [T] int64
        """The entries each query's sequence has at the step's end: the width transformers
        ranks its indexer scores over, whatever piece of the step (PCP) or batch holds it
        (equal scores resolve by that width: kernels.indexer_topk ``row_keys``)."""

        def make() -> torch.Tensor:
            return meta.seq_ends().to(self.positions.device)[self.query_row] // rate

        return self._get(("ranked", rate), make)

    def entry_slots(self, meta: AttentionMetadata, size: int, rate: int) -> torch.Tensor:
        """[T, E]: the slots of every entry each query may see (HCA); E: the most the
        step's tables hold, or (not decode-only) its longest sequence's."""

        def make() -> torch.Tensor:
            tables = self.query_tables(meta)
            bound = tables.shape[1] * size
            if not self.decode_only:
                bound = min(bound, max((end for _, end in self.spans), default=0) // rate)
            idx = torch.arange(bound, device=self.positions.device)[None, :]
            idx = torch.where(idx < self.closed(rate)[:, None], idx, -1)
            return v4_ops.slots_of(tables, idx, size, self.query_row)

        return self._get(("entries", id(meta), size, rate), make)

    def int32(self, name: str, meta: AttentionMetadata | None, rate: int) -> torch.Tensor:
        """The indexer's int32 copies (``tables`` of ``meta``, ``query_row``, ``closed``,
        ``ranked``), one a step."""

        def make() -> torch.Tensor:
            if name == "tables":
                assert meta is not None
                return self.query_tables(meta).to(torch.int32)
            if name == "query_row":
                return self.query_row.to(torch.int32)
            if name == "closed":
                return self.closed(rate).to(torch.int32)
            assert name == "ranked" and meta is not None
            return self.ranked(meta, rate).to(torch.int32)

        return self._get(("int32", name, None if meta is None else id(meta), rate), make)

    def closing_slots(
        self,
        meta: AttentionMetadata,  # the rows' group
        entries_meta: AttentionMetadata,  # the entries' group
        rate: int,
        overlap: bool,
        rows_block: int,
        entries_block: int,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """For the windows the step closes (``closing``'s order): the slots of their rows
        ([P, 2m], CSA: the previous window's too; [P, m]), each entry's slot ([P]), and
        which candidates close (None: all); -1 slots for those that do not. The same in
        every layer of this rate and groups: built once a step."""
        key = (
            "closing_slots",
            id(meta),
            id(entries_meta),
            rate,
            overlap,
            rows_block,
            entries_block,
        )
        seqs, wins, ok = self.closing(rate)
        pos_key = ("closing_pos", rate, overlap)  # the same in every group
        if pos_key not in self._memo:
            span = 2 * rate if overlap else rate
            first = self.win_starts(rate) - rate if overlap else self.win_starts(rate)
            pos = first[:, None] + torch.arange(span, device=wins.device)[None, :]  # [P, span]
            at = wins[:, None]
            if ok is not None:  # decodes: a candidate a sequence, those not closing masked
                pos, at = torch.where(ok[:, None], pos, -1), torch.where(ok[:, None], at, -1)
            self._memo[pos_key], self._memo[pos_key + ("at",)] = pos, at
        if key not in self._memo:
            pos, at = self._memo[pos_key], self._memo[pos_key + ("at",)]
            slots = v4_ops.slots_of(self.seq_tables(meta), pos, rows_block, seqs)
            at = v4_ops.slots_of(self.seq_tables(entries_meta), at, entries_block, seqs)[:, 0]
            self._memo[key], self._memo[key + ("at",)] = slots, at
        return self._memo[key], self._memo[key + ("at",)], ok

    def entry_rope(self, rope: Rope, rate: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin of the closing windows' first positions (their entries' rotation)."""
        key = ("entry_rope", id(rope), rate)
        if key not in self._memo:
            cos, sin = rope.cos_sin(self.win_starts(rate))
            self._memo[key], self._memo[key + ("sin",)] = cos, sin
        return self._memo[key], self._memo[key + ("sin",)]

    def closing(self, rate: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The windows the step closes, every sequence's (a PCP rank too): (sequence [P]
        (a row of ``seq_tables``), window [P], which of them close (None: all)). Window w
        closes at position ``w * m + m - 1``: a step of positions s .. e - 1 closes
        ``s // m .. e // m - 1``."""
        key = ("closing", rate)
        if self.decode_only:
            if key not in self._memo:
                self._memo[key] = torch.arange(self.nd, device=self.positions.device)
                self._memo[key + ("wins",)] = self.closed(rate) - 1
                self._memo[key + ("ok",)] = self.ends() % rate == 0
            return self._memo[key], self._memo[key + ("wins",)], self._memo[key + ("ok",)]
        if key not in self._memo:
            pairs = [
                (i, w)
                for i, (start, end) in enumerate(self.spans)
                for w in range(start // rate, end // rate)
            ]
            both = torch.tensor(pairs, dtype=torch.long).reshape(-1, 2)
            self._memo[key] = both.to(self.positions.device)
        both = self._memo[key]
        return both[:, 0], both[:, 1], None


class Compressor(nn.Module):
    """One series' pooling of windows of ``rate`` tokens into entries of ``dim`` (two
    overlapping series with ``overlap``: CSA's, and its indexer's)."""

    def __init__(self, hidden: int, dim: int, rate: int, overlap: bool, eps: float) -> None:
        super().__init__()
        self.dim, self.rate, self.overlap = dim, rate, overlap
        width = 2 * dim if overlap else dim
        self.wkv = nn.Linear(hidden, width, bias=False)
        self.wgate = nn.Linear(hidden, width, bias=False)
        self.ape = nn.Parameter(torch.zeros(rate, width))
        self.norm = RMSNorm(dim, eps)

    @property
    def width(self) -> int:
        """Values a token's row holds for this compressor: its kv and its gate."""
        return 2 * self.wkv.out_features

    def entries(
        self,
        rows_cache: torch.Tensor,  # [N, 1, 1, B, row]
        slots: torch.Tensor,  # [P, 2m or m]: the closing windows' rows (previous window's too)
        offset: int,  # this compressor's kv and gate in a row
        cos_sin: tuple[torch.Tensor, torch.Tensor],  # [P, rope / 2]: of each window's first
        fp8: Fp8Rows | None,
    ) -> torch.Tensor:  # [P, dim]
        """The entries of the closing windows (kernels: v4_ops.compress), rotated at the
        first position of each window (V4Step.entry_rope)."""
        dtype = self.wkv.weight.dtype
        return v4_ops.compress(
            rows_cache, slots, offset, self.ape, self.norm.weight, self.norm.eps,
            self.overlap, dtype, fp8, cos_sin,
        )  # fmt: skip


class Indexer(nn.Module):
    """CSA's lightning indexer: the top ``index_topk`` closed entries of each query."""

    def __init__(self, cfg: ModelConfig, rate: int) -> None:
        super().__init__()
        v4 = cfg.v4
        assert v4 is not None
        self.num_heads, self.head_dim, self.topk = (
            v4.index_n_heads,
            v4.index_head_dim,
            v4.index_topk,
        )
        self.wq_b = nn.Linear(v4.q_lora_rank, self.num_heads * self.head_dim, bias=False)
        self.weights_proj = nn.Linear(cfg.hidden_size, self.num_heads, bias=False)
        self.compressor = Compressor(cfg.hidden_size, self.head_dim, rate, True, cfg.rms_norm_eps)

    def select(
        self,
        q_resid: torch.Tensor,  # [T, q_lora_rank]
        head_logits: torch.Tensor,  # [T, H]: weights_proj(x)
        cos_sin: tuple[torch.Tensor, torch.Tensor],  # of the queries' positions
        entries_cache: torch.Tensor,  # [N, 1, 1, B, row]
        key_format: KeyFormat,
        tables: torch.Tensor,  # [R, max_blocks] int32: the entries' block tables
        query_row: torch.Tensor,  # [T] int32: each query's row of them
        closed: torch.Tensor,  # [T] int32: entries each query may see
        ranked: torch.Tensor | None,  # [T] int32: entries its sequence has (V4Step.ranked);
        # None on the Triton path, whose ties resolve at any width (kernels.indexer_topk)
    ) -> torch.Tensor:  # [T, index_topk] int32 entry indices, -1 pads
        q = self.wq_b(q_resid).view(-1, self.num_heads, self.head_dim)
        q = Rope.apply(q, *cos_sin)
        # transformers' DeepseekV4IndexerScorer: its H**-0.5 folded into the weights
        weights = head_logits.float() * self.num_heads**-0.5  # [T, H]
        return kernels.indexer_topk(
            q, weights, entries_cache[:, 0, 0], key_format, tables, query_row, closed,
            self.topk, ranked,
        )  # fmt: skip


class V4Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, par: ParallelContext) -> None:
        super().__init__()
        v4 = cfg.v4
        assert v4 is not None
        self.par = par
        self.kind = v4.layer_kinds[layer]
        # this rank's heads and output groups (whole groups: common/model/deepseek/dsv4_tp.py)
        self.num_heads, self.head_dim = cfg.num_attention_heads // par.tp_size, cfg.head_dim
        self.window = 0  # set by the model: transformers' sliding_window
        self.rope_dim = v4.rope_dim  # fp8 rows keep these last values in bf16
        self.eps = cfg.rms_norm_eps
        self.groups = v4.o_groups // par.tp_size
        hidden = cfg.hidden_size
        self.wq_a = nn.Linear(hidden, v4.q_lora_rank, bias=False)
        self.q_norm = RMSNorm(v4.q_lora_rank, cfg.rms_norm_eps)
        self.wq_b = nn.Linear(v4.q_lora_rank, self.num_heads * self.head_dim, bias=False)
        self.wkv = nn.Linear(hidden, self.head_dim, bias=False)
        self.norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        per_group = cfg.num_attention_heads * self.head_dim // v4.o_groups
        self.wo_a = nn.Linear(per_group, self.groups * v4.o_lora_rank, bias=False)
        self.wo_b = nn.Linear(self.groups * v4.o_lora_rank, hidden, bias=False)
        self.attn_sink = nn.Parameter(torch.zeros(self.num_heads))
        self.compressor: Compressor | None = None
        self.indexer: Indexer | None = None
        self.x_packed: torch.Tensor | None = None  # pack(): x's linears as one GEMM
        if self.kind != SLIDING:
            rate = v4.rate(layer)
            self.compressor = Compressor(hidden, self.head_dim, rate, self.kind == CSA, self.eps)
        if self.kind == CSA:
            self.indexer = Indexer(cfg, v4.rate(layer))

    def _x_linears(self) -> list[nn.Linear]:
        """Every linear of the layer's input, in ``pack``'s order: wq_a, wkv, each
        compressor's wkv and wgate (the row's order), the indexer's weights_proj."""
        lins = [self.wq_a, self.wkv]
        for comp in self._compressors():
            lins += [comp.wkv, comp.wgate]
        return lins + ([] if self.indexer is None else [self.indexer.weights_proj])

    def pack(self) -> None:
        """The linears of x as one [sum(out), hidden] matrix, their weights views into it
        (the state dict unchanged): one GEMM a layer instead of up to 7 (on CUDA, after
        the load and the TP cut: V4CausalLM.pack_weights; the CPU path runs each
        projection as stored, transformers' arithmetic)."""
        self.x_packed = pack_linears(self._x_linears())[0]

    def _project_x(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Each of ``_x_linears`` applied to x: one GEMM's column slices when packed (and
        still so: a weight reassigned since, e.g. a reload, unpacks)."""
        lins = self._x_linears()
        packed = self.x_packed
        if packed is not None and lins[0].weight.data_ptr() == packed.data_ptr():
            return list(F.linear(x, packed).split([lin.out_features for lin in lins], dim=-1))
        return [lin(x) for lin in lins]

    def _compressors(self) -> list[Compressor]:
        """The compressors whose projections a token's row holds, in the row's order."""
        comps = [] if self.compressor is None else [self.compressor]
        return comps + ([] if self.indexer is None else [self.indexer.compressor])

    def _fp8(self, cache: torch.Tensor) -> Fp8Rows | None:
        if not fp8_ds_v4.is_fp8(cache.dtype):
            return None
        index_dim = self.indexer.head_dim if self.indexer is not None else 0
        return Fp8Rows(self.head_dim, self.rope_dim, index_dim)

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]
        rope: Rope,  # this layer's: main (sliding) or compress
        cos_sin: tuple[torch.Tensor, torch.Tensor],  # rope's, of the step's positions
        rows_cache: torch.Tensor,  # [N, 1, 1, B, row]: per-token rows, a window's kept
        meta: AttentionMetadata,  # of the rows' group
        entries_cache: torch.Tensor | None,  # [N, 1, 1, B, row]: compressed entries
        entries_meta: AttentionMetadata | None,  # of the entries' group
        step: V4Step | None = None,  # the step's index metadata (built here if None)
        positions: torch.Tensor | None = None,  # [T]: needed when step is None
    ) -> torch.Tensor:  # [T, hidden]
        if step is None:
            assert positions is not None
            step = V4Step(meta, positions)
        num_tokens = x.shape[0]
        proj = self._project_x(x)  # wq_a, wkv, the compressors' (, weights_proj)
        q_resid = self.q_norm(proj[0])
        q = self.wq_b(q_resid).view(num_tokens, self.num_heads, self.head_dim)
        q = v4_ops.norm_rope(q, None, self.eps, *cos_sin)  # rms, then the rope
        kv = v4_ops.norm_rope(proj[1], self.norm.weight, self.eps, *cos_sin)  # [T, D]
        ncomp = 2 * len(self._compressors())
        parts = [kv, *proj[2 : 2 + ncomp]]  # the row: K=V, each compressor's kv and gate
        fp8 = self._fp8(rows_cache)
        if fp8 is None and meta.kv_gather is None:  # cat, pad, cast, write: one call
            v4_ops.write_parts(rows_cache, parts, meta.slot_mapping)
        else:
            row = torch.cat(parts, dim=-1)
            if meta.kv_gather is not None:  # PCP: every rank writes every new token's row
                row = meta.kv_gather(row[None])[0]
            if fp8 is not None:  # each rank quantizes the same rows
                row = fp8_ds_v4.pack_rows(row, self.head_dim, self.rope_dim, rows_cache.shape[-1])
            row = F.pad(row, (0, rows_cache.shape[-1] - row.shape[-1])).to(rows_cache.dtype)
            v4_ops.write_rows(rows_cache, row, meta.slot_mapping)
        entry_slots = None
        if self.compressor is not None:
            assert entries_cache is not None and entries_meta is not None
            self._close_windows(rows_cache, meta, entries_cache, entries_meta, rope, step, fp8)
            if num_tokens:
                entry_slots = self._entry_slots(
                    q_resid, proj[2 + ncomp :], cos_sin, entries_cache, entries_meta, step, fp8
                )
        if num_tokens == 0:  # a PCP rank with no piece of this step still wrote and pooled
            return self._project_out(torch.empty_like(q))
        size = rows_cache.shape[3]
        window_slots = step.window_slots(meta, size, self.window)
        out = v4_ops.sink_attention(
            q, rows_cache, window_slots, entries_cache, entry_slots, self.attn_sink,
            self.head_dim**-0.5, fp8,
        )  # fmt: skip
        out = v4_ops.norm_rope(out, None, None, *cos_sin, inverse=True)  # values' rotation undone
        return self._project_out(out)

    def _entry_slots(
        self,
        q_resid: torch.Tensor,
        head_logits: list[torch.Tensor],  # [the indexer's weights_proj(x)] (CSA); []
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        entries_cache: torch.Tensor,
        entries_meta: AttentionMetadata,
        step: V4Step,
        fp8: Fp8Rows | None,
    ) -> torch.Tensor:  # [T, E] slots of the entries each query attends, -1 none
        comp = self.compressor
        assert comp is not None
        size = entries_cache.shape[3]
        if self.indexer is None:  # HCA: every closed entry
            return step.entry_slots(entries_meta, size, comp.rate)
        key_format = KeyFormat.v4_entry(
            self.head_dim, self.rope_dim, self.indexer.head_dim, fp8 is not None
        )
        rate = comp.rate
        triton = kernels.backend_name(q_resid.device) == "triton"  # takes no row_keys
        top = self.indexer.select(
            q_resid, head_logits[0], cos_sin, entries_cache, key_format,
            step.int32("tables", entries_meta, rate), step.int32("query_row", None, 0),
            step.int32("closed", None, rate),
            None if triton else step.int32("ranked", entries_meta, rate),
        )  # fmt: skip
        return v4_ops.slots_of(step.query_tables(entries_meta), top, size, step.query_row)

    def _close_windows(
        self,
        rows_cache: torch.Tensor,
        meta: AttentionMetadata,
        entries_cache: torch.Tensor,
        entries_meta: AttentionMetadata,
        rope: Rope,
        step: V4Step,
        fp8: Fp8Rows | None,
    ) -> None:
        """Pool every window the step closed, of every sequence (every rank: the state
        must be whole on each PCP rank), into entries, in one call a compressor; their
        tokens' rows are in the rows' window (its span covers 2m, common/model/
        dsv4_config.py ``cache_kinds``)."""
        comp = self.compressor
        assert comp is not None
        if step.closing(comp.rate)[0].shape[0] == 0:
            return
        d = self.head_dim
        slots, at, ok = step.closing_slots(
            meta, entries_meta, comp.rate, comp.overlap, rows_cache.shape[3],
            entries_cache.shape[3],
        )  # fmt: skip
        cos_sin = step.entry_rope(rope, comp.rate)
        parts = [comp.entries(rows_cache, slots, d, cos_sin, fp8)]
        if self.indexer is not None:
            index = self.indexer.compressor
            parts.append(index.entries(rows_cache, slots, d + comp.width, cos_sin, fp8))
        if fp8 is None:  # cat, pad, cast, write in one call; a masked candidate unwritten
            v4_ops.write_parts(entries_cache, parts, at)
            return
        entry = torch.cat(parts, dim=-1)  # [P, D (+ index_head_dim)]
        if ok is not None:
            entry = torch.where(ok[:, None], entry, 0)  # a masked candidate's (never written)
        width = entries_cache.shape[-1]
        entry = fp8_ds_v4.pack_entries(entry, d, self.rope_dim, width)
        entry = F.pad(entry, (0, width - entry.shape[-1])).to(entries_cache.dtype)
        v4_ops.write_rows(entries_cache, entry, at)

    def _project_out(self, out: torch.Tensor) -> torch.Tensor:  # [T, H, D] -> [T, hidden]
        """The grouped low-rank output: each group of heads through its block of wo_a;
        under TP each rank's groups, wo_b's partial sums all-reduced."""
        num_tokens = out.shape[0]
        grouped = out.reshape(num_tokens, self.groups, -1).transpose(0, 1)  # [g, T, in]
        w = self.wo_a.weight.view(self.groups, -1, grouped.shape[-1]).transpose(1, 2)
        mid = torch.bmm(grouped, w).transpose(0, 1).reshape(num_tokens, -1)  # [T, g * r]
        return self.par.all_reduce_tp(self.wo_b(mid))
