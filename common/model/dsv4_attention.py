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

Tensor parallel (common/model/dsv4_tp.py): a rank holds ``H / N`` query heads, their sinks
and their ``o_groups / N`` output groups; ``wo_b`` is row-parallel (all-reduced). The K=V
row, the compressors and the indexer are replicated: every rank writes the same cache.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from pdserve.common.model.attention import AttentionMetadata
from pdserve.common.model.config import ModelConfig
from pdserve.common.model.dsa import sequences, write_rows
from pdserve.common.model.dsv4_config import CSA, SLIDING
from pdserve.common.model.rope import inv_frequencies
from pdserve.common.parallel.context import ParallelContext
from pdserve.kernels import fp8_ds_v4


def rows_at(
    cache: torch.Tensor,  # [N, 1, 1, B, row]
    table: torch.Tensor,  # [max_blocks] int: one sequence's block table of the cache's group
    start: int,
    end: int,
) -> torch.Tensor:  # [end - start, row]: the slots start .. end - 1 of the sequence
    size = cache.shape[3]
    pos = torch.arange(start, end, device=cache.device)
    return cache[table.to(cache.device)[pos // size].long(), 0, 0, pos % size]


def rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' DeepseekV4UnweightedRMSNorm."""
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


class RMSNorm(nn.Module):
    """transformers' DeepseekV4RMSNorm (in float32, weight applied before the cast back)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * h).to(x.dtype)


class Rope:
    """V4's interleaved rope over the trailing ``rope_dim`` values of each head: cos/sin of
    one entry per pair (``rope_dim / 2``), yarn's attention factor left at 1 as
    transformers sets it for V4."""

    def __init__(self, rope_dim: int, theta: float, scaling: dict[str, object] | None) -> None:
        with torch.device("cpu"):
            self.inv_freq, _ = inv_frequencies(rope_dim, theta, scaling, 0)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq.to(positions.device)[None, :]
        return freqs.cos(), freqs.sin()  # [T, rope / 2]

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """``x`` [T, ..., D] with its last 2 * cos.shape[-1] values rotated at each row's
        position (cos/sin [T, rope / 2]), as transformers' apply_rotary_pos_emb."""
        cos = cos.repeat_interleave(2, dim=-1)
        sin = sin.repeat_interleave(2, dim=-1)
        for _ in range(x.dim() - 2):
            cos, sin = cos[:, None], sin[:, None]
        dim = cos.shape[-1]
        nope, rope = x[..., :-dim], x[..., -dim:]
        pairs = torch.stack((-rope[..., 1::2], rope[..., 0::2]), dim=-1).flatten(-2)
        rotated = (rope.float() * cos + pairs.float() * sin).to(x.dtype)
        return torch.cat((nope, rotated), dim=-1)


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

    def project(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden] -> [T, width]
        return torch.cat((self.wkv(x), self.wgate(x)), dim=-1)

    def entries(
        self, rows: torch.Tensor, first: int, rope: Rope
    ) -> torch.Tensor:  # rows [k * rate, width] -> [n, dim]
        """The entries of windows ``first ..`` from the rows of their tokens (with
        ``overlap`` and ``first`` > 0, the rows start a window earlier: CSA's first series)."""
        m, d = self.rate, self.dim
        prev = 1 if self.overlap and first > 0 else 0
        total = rows.shape[0] // m
        n = total - prev
        kv, gate = rows[: total * m].view(total, m, rows.shape[-1]).chunk(2, dim=-1)
        gate = gate + self.ape
        if self.overlap:  # entry w: window w - 1's first series, then window w's second
            pooled_kv = kv.new_zeros((n, 2 * m, d))
            pooled_gate = gate.new_full((n, 2 * m, d), float("-inf"))
            pooled_kv[:, m:], pooled_gate[:, m:] = kv[prev:, :, d:], gate[prev:, :, d:]
            skip = 1 - prev  # window 0 has no window before it
            pooled_kv[skip:, :m], pooled_gate[skip:, :m] = (
                kv[: total - 1, :, :d],
                gate[: total - 1, :, :d],
            )
            kv, gate = pooled_kv, pooled_gate
        out = self.norm((kv * gate.softmax(dim=1, dtype=torch.float32).to(kv.dtype)).sum(dim=1))
        positions = (torch.arange(n, device=rows.device) + first) * m
        return Rope.apply(out, *rope.cos_sin(positions))


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
        q_resid: torch.Tensor,  # [n, q_lora_rank]: the sequence's queries
        x: torch.Tensor,  # [n, hidden]
        cos_sin: tuple[torch.Tensor, torch.Tensor],  # of the queries' positions
        keys: torch.Tensor,  # [E, index_head_dim]: the closed entries
        closed: torch.Tensor,  # [n, E] bool: entries each query may see
    ) -> torch.Tensor:  # [n, E] bool: the entries each query attends
        q = self.wq_b(q_resid).view(-1, self.num_heads, self.head_dim)
        q = Rope.apply(q, *cos_sin)
        # op for op transformers' DeepseekV4IndexerScorer
        scores = torch.matmul(q.float(), keys.float().t()[None])  # [n, H, E]
        scores = F.relu(scores) * self.head_dim**-0.5
        weights = self.weights_proj(x).float() * self.num_heads**-0.5  # [n, H]
        index = (scores * weights[..., None]).sum(dim=1).masked_fill(~closed, float("-inf"))
        top = index.topk(min(self.topk, keys.shape[0]), dim=-1).indices
        return torch.zeros_like(closed).scatter_(-1, top, True) & closed


class V4Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, par: ParallelContext) -> None:
        super().__init__()
        v4 = cfg.v4
        assert v4 is not None
        self.par = par
        self.kind = v4.layer_kinds[layer]
        # this rank's heads and output groups (whole groups: common/model/dsv4_tp.py)
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
        if self.kind != SLIDING:
            rate = v4.rate(layer)
            self.compressor = Compressor(hidden, self.head_dim, rate, self.kind == CSA, self.eps)
        if self.kind == CSA:
            self.indexer = Indexer(cfg, v4.rate(layer))

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]
        rope: Rope,  # this layer's: main (sliding) or compress
        cos_sin: tuple[torch.Tensor, torch.Tensor],  # rope's, of the step's positions
        rows_cache: torch.Tensor,  # [N, 1, 1, B, row]: per-token rows, a window's kept
        meta: AttentionMetadata,  # of the rows' group
        entries_cache: torch.Tensor | None,  # [N, 1, 1, B, row]: compressed entries
        entries_meta: AttentionMetadata | None,  # of the entries' group
    ) -> torch.Tensor:  # [T, hidden]
        num_tokens = x.shape[0]
        q_resid = self.q_norm(self.wq_a(x))
        q = rms(self.wq_b(q_resid).view(num_tokens, self.num_heads, self.head_dim), self.eps)
        q = Rope.apply(q, *cos_sin)
        kv = Rope.apply(self.norm(self.wkv(x)), *cos_sin)  # [T, D]
        parts = [kv]
        if self.compressor is not None:
            parts.append(self.compressor.project(x))
        if self.indexer is not None:
            parts.append(self.indexer.compressor.project(x))
        row = torch.cat(parts, dim=-1)
        if meta.kv_gather is not None:  # PCP: every rank writes every new token's row
            row = meta.kv_gather(row[None])[0]
        if fp8_ds_v4.is_fp8(rows_cache.dtype):  # each rank quantizes the same rows
            row = fp8_ds_v4.pack_rows(row, self.head_dim, self.rope_dim, rows_cache.shape[-1])
        row = F.pad(row, (0, rows_cache.shape[-1] - row.shape[-1]))
        write_rows(rows_cache, row, meta.slot_mapping)
        seqs = sequences(meta)
        entry_tables: list[torch.Tensor | None] = [None] * len(seqs)
        if self.compressor is not None:
            assert entries_cache is not None and entries_meta is not None
            self._close_windows(rows_cache, meta, entries_cache, entries_meta, rope)
            entry_tables = [table for *_, table in sequences(entries_meta)]
        out = torch.empty_like(q)  # [T, H, D]
        for (lo, hi, ctx, table), entry_table in zip(seqs, entry_tables, strict=True):
            first = max(0, ctx - (hi - lo) - self.window + 1)
            rows = self._rows(rows_at(rows_cache, table, first, ctx))  # [ctx - first, row]
            entries = None
            if entry_table is not None and entries_cache is not None and self.compressor:
                num = ctx // self.compressor.rate  # every closed entry of the sequence
                entries = self._entries(rows_at(entries_cache, entry_table, 0, num))
            cs = (cos_sin[0][lo:hi], cos_sin[1][lo:hi])
            out[lo:hi] = self._attend(
                q[lo:hi], q_resid[lo:hi], x[lo:hi], cs, rows, first, ctx, entries
            )
        out = Rope.apply(out, cos_sin[0], -cos_sin[1])  # the values' rotation undone
        return self._project_out(out)

    def _close_windows(
        self,
        rows_cache: torch.Tensor,
        meta: AttentionMetadata,
        entries_cache: torch.Tensor,
        entries_meta: AttentionMetadata,
        rope: Rope,
    ) -> None:
        """Pool the windows each sequence's step closed into entries (every rank, every
        sequence: the state must be whole on each PCP rank). A window w closes at position
        ``w * m + m - 1``: a step of positions s .. e - 1 closes ``s // m .. e // m - 1``;
        their tokens' rows are in the rows' window (its span covers 2m, common/model/
        dsv4_config.py ``cache_kinds``)."""
        comp = self.compressor
        assert comp is not None and meta.seq_block_tables is not None
        assert entries_meta.seq_block_tables is not None
        m, d = comp.rate, self.head_dim
        for i, (start, end) in enumerate(meta.seq_spans):
            first, stop = start // m, end // m
            if first == stop:
                continue
            lo = (first - 1) * m if comp.overlap and first > 0 else first * m
            rows = self._rows(rows_at(rows_cache, meta.seq_block_tables[i], lo, stop * m))
            parts = [comp.entries(rows[:, d : d + comp.width], first, rope)]
            if self.indexer is not None:
                at = d + comp.width
                index = self.indexer.compressor
                parts.append(index.entries(rows[:, at : at + index.width], first, rope))
            entry = torch.cat(parts, dim=-1)  # [stop - first, D (+ index_head_dim)]
            if fp8_ds_v4.is_fp8(entries_cache.dtype):
                width = entries_cache.shape[-1]
                entry = fp8_ds_v4.pack_entries(entry, d, self.rope_dim, width)
            entry = F.pad(entry, (0, entries_cache.shape[-1] - entry.shape[-1]))
            w = torch.arange(first, stop, device=entry.device)
            size = entries_cache.shape[3]
            table = entries_meta.seq_block_tables[i].to(w.device).long()
            entries_cache[table[w // size], 0, 0, w % size] = entry.to(entries_cache.dtype)

    def _rows(self, raw: torch.Tensor) -> torch.Tensor:  # [n, row] -> model dtype
        """Per-token rows as the auto cache holds them; fp8 ones dequantized."""
        dtype = self.wkv.weight.dtype
        if not fp8_ds_v4.is_fp8(raw.dtype):
            return raw.to(dtype)
        return fp8_ds_v4.unpack_rows(raw, self.head_dim, self.rope_dim, dtype)

    def _entries(self, raw: torch.Tensor) -> torch.Tensor:  # [E, row] -> model dtype
        dtype = self.wkv.weight.dtype
        if not fp8_ds_v4.is_fp8(raw.dtype):
            return raw.to(dtype)
        index_dim = self.indexer.head_dim if self.indexer is not None else 0
        return fp8_ds_v4.unpack_entries(raw, self.head_dim, self.rope_dim, index_dim, dtype)

    def _attend(
        self,
        q: torch.Tensor,  # [n, H, D]: one sequence's queries, positions ctx - n .. ctx - 1
        q_resid: torch.Tensor,  # [n, q_lora_rank]
        x: torch.Tensor,  # [n, hidden]
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        rows: torch.Tensor,  # [ctx - first, row]: the rows of positions first .. ctx - 1
        first: int,
        ctx: int,
        entries: torch.Tensor | None,  # [E, row]: the closed entries (D, indexer key)
    ) -> torch.Tensor:  # [n, H, D]
        n, d = q.shape[0], self.head_dim
        device = q.device
        pos = torch.arange(ctx - n, ctx, device=device)[:, None]  # [n, 1]
        keys = torch.arange(first, ctx, device=device)[None, :]
        visible = (keys <= pos) & (keys > pos - self.window)  # [n, ctx - first]
        kv = rows[:, :d]
        if entries is not None:
            assert self.compressor is not None
            num = entries.shape[0]
            closed = torch.arange(num, device=device)[None, :] < (pos + 1) // self.compressor.rate
            if self.indexer is not None:
                index_keys = entries[:, d : d + self.indexer.head_dim]
                closed = self.indexer.select(q_resid, x, cos_sin, index_keys, closed)
            kv = torch.cat((kv, entries[:, :d]), dim=0)
            visible = torch.cat((visible, closed), dim=-1)
        # transformers' eager attention with sinks, op for op
        logits = torch.matmul(q.transpose(0, 1), kv.t()) * d**-0.5  # [H, n, K]
        logits = logits.masked_fill(~visible[None], float("-inf"))
        sinks = self.attn_sink.reshape(-1, 1, 1).expand(-1, n, 1).to(logits.dtype)
        logits = torch.cat((logits, sinks), dim=-1)
        logits = logits - logits.max(dim=-1, keepdim=True).values
        probs = F.softmax(logits, dim=-1)[..., :-1]
        return torch.matmul(probs.to(kv.dtype), kv).transpose(0, 1)  # [n, H, D]

    def _project_out(self, out: torch.Tensor) -> torch.Tensor:  # [T, H, D] -> [T, hidden]
        """The grouped low-rank output: each group of heads through its block of wo_a;
        under TP each rank's groups, wo_b's partial sums all-reduced."""
        num_tokens = out.shape[0]
        grouped = out.reshape(num_tokens, self.groups, -1).transpose(0, 1)  # [g, T, in]
        w = self.wo_a.weight.view(self.groups, -1, grouped.shape[-1]).transpose(1, 2)
        mid = torch.bmm(grouped, w).transpose(0, 1).reshape(num_tokens, -1)  # [T, g * r]
        return self.par.all_reduce_tp(self.wo_b(mid))
