"""CUDA graphs of decode steps: one captured graph per padded batch size.

A decode step of a small model is hundreds of short kernels; launched one by one from
Python, the launches, not the GPU, set the pace (engine_h200.json before graphs: 17.7 ms
a step at batch 1 for a 1B model whose weights take ~0.6 ms to read). Replaying a captured
graph launches them all at once.

Every input of the step lives in static buffers that the graphs read: token ids,
positions, slots, context lengths, block tables. A step of ``n`` sequences replays the
graph of the smallest captured size ``>= n``; the padding rows have context length 0 and
slot -1, so they write no KV and read none, and their logits are dropped. Only steps in
which every sequence decodes one token (and samples) are replayed; anything else (prefill
chunks, recomputation, a larger batch) runs eagerly. The graphs need kernels without host
syncs: the Triton path (kernels.backend_name() == "triton") and one rank (TP 1, PCP 1).

A cache of several KV cache groups (common/engine/kv_groups.py) has static slots and
block tables per group; each layer's captured kernels read its group's.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

import structlog
import torch

from pdserve.common.engine.async_steps import Carry
from pdserve.common.engine.step_plan import StepPlan
from pdserve.common.model.decoder import CausalLM
from pdserve.common.model.layers.attention import AttentionMetadata

log = structlog.get_logger("pdserve.cuda_graphs")

BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)


def graph_sizes(max_batch: int) -> list[int]:
    """Captured sizes up to ``max_batch`` (always included)."""
    return sorted({b for b in BATCH_SIZES if b < max_batch} | {max_batch})


def padded_batch(num_seqs: int, max_batch: int) -> int:
    """The captured size a decode step of ``num_seqs`` sequences replays (itself past the
    largest, or with no graphs at all)."""
    if max_batch < 1 or num_seqs > max_batch:
        return num_seqs
    return next(s for s in graph_sizes(max_batch) if s >= num_seqs)


def is_decode_step(plan: StepPlan) -> bool:
    return bool(plan.seqs) and all(len(s.token_ids) == 1 and s.sample for s in plan.seqs)


class DecodeGraphs:
    def __init__(
        self,
        model: CausalLM,
        kv_cache: torch.Tensor,
        block_size: int,
        max_batch: int,
        max_blocks: int,
        kv_scales: tuple[float, float] = (1.0, 1.0),  # fp8 caches: (k_scale, v_scale)
        rates: tuple[int, ...] = (),  # each group's tokens per slot (kv_groups.py); none: all 1
    ) -> None:
        started = time.perf_counter()
        device = kv_cache.device
        self.block_size = block_size
        self.sizes = graph_sizes(max_batch)
        # rows: token ids, positions, slots, context lengths (int64, one copy per step)
        self._inputs = torch.zeros((4, max_batch), dtype=torch.int64, device=device)
        self._inputs[2].fill_(-1)
        self._tables = torch.zeros((max_batch, max_blocks), dtype=torch.int32, device=device)
        # groups 1..: their slots and block tables (group 0's are the rows above)
        self.num_groups = 1 + max((g for g, _ in model.kv_slots), default=0)
        # a compressed group (rate > 1, DeepSeek-V4's entries) has no per-token slot: the
        # model writes its entries itself (common/engine/group_meta.py); its slots stay -1
        self._rates = tuple(rates) or (1,) * self.num_groups
        extra = self.num_groups - 1
        self._group_slots = torch.full((extra, max_batch), -1, dtype=torch.int64, device=device)
        self._group_tables = torch.zeros(
            (extra, max_batch, max_blocks), dtype=torch.int32, device=device
        )
        # A graph holds raw addresses, not references: every tensor it reads must outlive
        # it (a freed one is reused by the allocator, and the graph reads garbage).
        self._rows = torch.arange(max_batch, dtype=torch.int64, device=device)
        empty = torch.zeros(0, dtype=torch.int32, device=device)
        self._keep: list[AttentionMetadata] = []
        # size -> (graph, its logits, its pre-norm hidden states when the model keeps them:
        # the MTP proposer reads them, common/engine/spec_decode/mtp.py)
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor | None]] = {}
        self._model = model
        # called with each plan a graph replays (tests count verify steps' replays with it)
        self.on_replay: Callable[[StepPlan], None] | None = None
        pool = None
        for size in reversed(self.sizes):  # largest first: the smaller ones reuse its pool
            meta = AttentionMetadata(
                slot_mapping=self._inputs[2, :size], num_decode_tokens=size,
                decode_context_lens=self._inputs[3, :size], decode_block_tables=self._tables[:size],
                prefill_cu_seqlens_q=torch.zeros(1, dtype=torch.int32, device=device),
                prefill_context_lens=empty, prefill_block_tables=empty.view(0, 0),
                decode_splits=model.decode_splits(size, kv_cache.shape[3], device),
                k_scale=kv_scales[0], v_scale=kv_scales[1],
            )  # fmt: skip
            meta = dataclasses.replace(meta, groups=tuple(
                dataclasses.replace(meta, slot_mapping=self._group_slots[g, :size],
                                    decode_block_tables=self._group_tables[g, :size])
                for g in range(extra)
            ))  # fmt: skip
            self._keep.append(meta)
            args = (
                self._inputs[0, :size],
                self._inputs[1, :size],
                kv_cache,
                meta,
                self._rows[:size],
            )
            with torch.inference_mode():
                model(*args)  # warm-up: Triton compiles, cuBLAS picks its kernels
                torch.cuda.synchronize(device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
                    logits = model(*args)
            pool = graph.pool()
            self._graphs[size] = (graph, logits, model.hidden if model.keep_hidden else None)
        torch.cuda.synchronize(device)
        self.capture_seconds = time.perf_counter() - started
        log.info("cuda_graphs_captured", sizes=self.sizes, seconds=round(self.capture_seconds, 2))

    def run(self, plan: StepPlan, carry: Carry | None = None) -> torch.Tensor | None:
        """Logits [n, vocab] of a decode step (valid until the next replay); None when the
        step is not one the graphs can run (see module doc). ``carry``: token ids the step
        in flight sampled, read on the device (common/engine/async_steps.py)."""
        n = len(plan.seqs)
        if n > self.sizes[-1] or not is_decode_step(plan):
            return None
        size = padded_batch(n, self.sizes[-1])
        width = max(len(s.block_ids) for s in plan.seqs)
        if width > self._tables.shape[1]:
            return None
        if any(len(s.group_block_ids) != self.num_groups - 1 for s in plan.seqs):
            return None
        bs, pad = self.block_size, size - n
        positions = [s.start_position for s in plan.seqs]
        slots = [
            s.block_ids[p // bs] * bs + p % bs for s, p in zip(plan.seqs, positions, strict=True)
        ]
        host = torch.tensor([
            [s.token_ids[0] for s in plan.seqs] + [0] * pad,
            positions + [0] * pad,
            slots + [-1] * pad,
            [p + 1 for p in positions] + [0] * pad,
        ], dtype=torch.int64)  # fmt: skip
        tables = torch.tensor(
            [s.block_ids + [0] * (width - len(s.block_ids)) for s in plan.seqs], dtype=torch.int32
        )
        # pinned: the copies queue behind the step in flight instead of waiting for it
        self._inputs[:, :size].copy_(host.pin_memory(), non_blocking=True)
        self._tables[:n, :width].copy_(tables.pin_memory(), non_blocking=True)
        if carry is not None:
            carry.apply(self._inputs[0], list(range(n)))
        for g in range(1, self.num_groups):
            rows = [s.table(g) for s in plan.seqs]
            if self._rates[g] == 1:
                group_slots = [
                    t[p // bs] * bs + p % bs for t, p in zip(rows, positions, strict=True)
                ]
            else:
                group_slots = [-1] * n
            self._group_slots[g - 1, :size].copy_(
                torch.tensor(group_slots + [-1] * pad, dtype=torch.int64), non_blocking=True
            )
            self._group_tables[g - 1, :n, :width].copy_(
                torch.tensor([t + [0] * (width - len(t)) for t in rows], dtype=torch.int32),
                non_blocking=True,
            )
        graph, logits, hidden = self._graphs[size]
        graph.replay()
        if self.on_replay is not None:
            self.on_replay(plan)
        if hidden is not None:
            self._model.hidden = hidden[:n]
            if hasattr(self._model, "hidden_rows"):  # DeepSeek-V4's, which DSpark reads:
                self._model.hidden_rows = hidden[:n]  # a graph's rows are all logits rows
        return logits[:n]
