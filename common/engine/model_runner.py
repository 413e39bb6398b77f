"""ModelRunner: one rank's weights and KV cache; executes a StepPlan into logits."""

from __future__ import annotations

import hashlib
import itertools
import time
from pathlib import Path
from typing import Any

import msgspec
import structlog
import torch

from pdserve import kernels
from pdserve.common.engine.async_steps import Carry
from pdserve.common.engine.config import EngineConfig
from pdserve.common.engine.cuda_graphs import DecodeGraphs, padded_batch
from pdserve.common.engine.group_meta import with_groups, with_groups_pcp
from pdserve.common.engine.host_malloc import keep_freed_buffers
from pdserve.common.engine.kv_cache import new_cache
from pdserve.common.engine.kv_groups import cache_groups, page_layers
from pdserve.common.engine.kv_layout import KVLayout
from pdserve.common.engine.latent_format import cache_head
from pdserve.common.engine.model_loader import load_model
from pdserve.common.engine.prompt_logprobs import PromptScores, ScoreRow, rows_of_piece, score_rows
from pdserve.common.engine.spec_decode.verify_rows import as_decode_rows
from pdserve.common.engine.step_plan import ScheduledSeq, StepPlan
from pdserve.common.errors import ModelLoadError
from pdserve.common.model.checkpoint.config import ModelConfig
from pdserve.common.model.checkpoint.moe_config import check_ep
from pdserve.common.model.layers.attention import AttentionMetadata
from pdserve.common.parallel.context import ParallelContext
from pdserve.common.parallel.tp import check_tp, kv_heads_of
from pdserve.common.parallel.zigzag import rank_pieces

log = structlog.get_logger("pdserve.model_runner")


class ModelRunner:
    def __init__(
        self,
        cfg: ModelConfig,
        model_dir: Path,
        *,
        device: str,
        dtype: str,
        block_size: int,
        num_blocks: int | None,
        kv_cache_memory_gb: float,
        gpu_memory_utilization: float,
        parallel: ParallelContext | None = None,
        kv_order: str = "head",
        kv_cache_dtype: str | None = None,
        cuda_graph_max_batch: int = 0,
        cuda_graphs: bool = True,
        max_model_len: int | None = None,
        cpu_weight_prepack: bool = False,
    ) -> None:
        self.cfg = cfg
        self.model_dir = model_dir
        # the last step's prompt logprobs, of this rank's positions (prompt_logprobs.py)
        self.last_prompt_logprobs: PromptScores = {}
        self._score_rows: list[ScoreRow] = []
        self.parallel = parallel or ParallelContext()
        self.device = torch.device(device)
        self.dtype = getattr(torch, dtype)
        if self.device.type == "cpu":
            keep_freed_buffers()  # a CPU step's MB-sized buffers stay in the heap
            kernels.prepare_cpu()  # the compiled decode attention, built once per machine
        started = time.perf_counter()
        reason = check_tp(
            self.parallel.tp_size,
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.intermediate_size,
        ) or check_ep(self.parallel.tp_size, cfg.moe)
        if reason:
            raise ModelLoadError(f"{model_dir}: {reason}")
        self.model = load_model(
            cfg, model_dir, self.dtype, self.device, self.parallel, cpu_weight_prepack
        )
        self.load_seconds = time.perf_counter() - started
        # MLA with fp8: the latent as fp8_ds_mla records (uint8, 656 bytes a token in V3)
        try:
            head_dim, num_kv_parts, cache_dtype = cache_head(cfg, dtype, kv_cache_dtype)
        except ValueError as exc:
            raise ModelLoadError(f"{model_dir}: --kv-cache-dtype: {exc}") from exc
        # A block holds the layers of one KV cache group (common/engine/kv_groups.py).
        groups = cache_groups(cfg)
        self.group_rates = [g.rate for g in groups]
        probe = KVLayout(
            num_blocks=1,
            num_layers=page_layers(groups) if len(groups) > 1 else cfg.num_hidden_layers,
            num_kv_heads=kv_heads_of(
                cfg.num_key_value_heads, self.parallel.tp_size, self.parallel.tp_rank
            )[1],
            block_size=block_size,
            head_dim=head_dim,
            dtype=cache_dtype,
            order="block" if kv_order == "block" else "head",
            num_kv_parts=num_kv_parts,
        )
        if num_blocks is None:
            num_blocks = self._blocks_for_memory(
                probe.block_bytes, kv_cache_memory_gb, gpu_memory_utilization
            )
        self.layout = msgspec.structs.replace(probe, num_blocks=num_blocks)
        # logical [N, L, 2, H_kv, B, D] over head-major storage (common/engine/kv_layout.py)
        self.kv_cache = new_cache(self.layout, self.device)
        self.graphs: DecodeGraphs | None = None
        # steps replayed from a graph, and the others (pdserve:model_steps)
        self.num_graph_steps = self.num_eager_steps = 0
        # Graph sizes pad decode batches; eager steps pad the same way for the kernels' split
        # (AttentionMetadata.decode_splits), graphs on or off, so both sum alike.
        self._graph_max_batch = cuda_graph_max_batch
        self._use_graphs = cuda_graphs
        self._max_model_len = max_model_len or cfg.max_position_embeddings
        self._capture_graphs()
        log.info(
            "model_loaded",
            model=str(model_dir),
            device=device,
            dtype=dtype,
            kv_cache_dtype=self.layout.dtype,
            load_seconds=round(self.load_seconds, 2),
            num_kv_blocks=num_blocks,
            kv_cache_mib=round(self.layout.total_bytes / 2**20),
        )

    def resize(self, num_blocks: int) -> None:
        """Re-make the KV cache with ``num_blocks`` blocks (PCP ranks agree on one size)."""
        if num_blocks != self.layout.num_blocks:
            self.layout = msgspec.structs.replace(self.layout, num_blocks=num_blocks)
            self.graphs = None  # they hold the old cache's address
            self.kv_cache = new_cache(self.layout, self.device)
            self._capture_graphs()

    def recapture_graphs(self) -> None:
        """Capture the decode graphs again, after a change to what the forward does."""
        self.graphs = None
        self._capture_graphs()

    def _capture_graphs(self) -> None:
        """CUDA graphs of decode steps (common/engine/cuda_graphs.py), where they can run."""
        par = self.parallel
        if (
            not self._use_graphs
            or self._graph_max_batch < 1
            or self.device.type != "cuda"
            or par.tp_size > 1
            or par.pcp_size > 1
            or kernels.backend_name(self.device) != "triton"
        ):
            return
        refused = getattr(self.model, "cuda_graphs_refused", None)
        if refused:  # a model whose decode step no graph can capture yet says why
            log.info("cuda graphs off", model=self.cfg.model_type, reason=refused)
            return
        max_blocks = min(self.layout.num_blocks, -(-self._max_model_len // self.layout.block_size))
        self.graphs = DecodeGraphs(
            self.model,
            self.kv_cache,
            self.layout.block_size,
            self._graph_max_batch,
            max_blocks,
            kv_scales=(self.layout.k_scale, self.layout.v_scale),
            rates=tuple(self.group_rates),
        )

    def kv_compat(self) -> dict[str, str | int]:
        """What must be equal between a KV producer and its consumer (checked at handshake)."""
        return {
            "model": hashlib.sha256((self.model_dir / "config.json").read_bytes()).hexdigest()[:16],
            "dtype": self.layout.dtype,
            "block_size": self.layout.block_size,
            "num_layers": self.cfg.num_hidden_layers,
            "num_kv_heads": self.cfg.num_key_value_heads,
            "head_dim": self.cfg.head_dim,
        }

    @classmethod
    def from_config(
        cls, cfg: ModelConfig, model_dir: Path, config: EngineConfig, **kwargs: Any
    ) -> ModelRunner:
        return cls(
            cfg,
            model_dir,
            device=config.device,
            dtype=config.torch_dtype_name,
            block_size=config.block_size,
            num_blocks=config.num_kv_blocks,
            kv_cache_memory_gb=config.kv_cache_memory_gb,
            gpu_memory_utilization=config.gpu_memory_utilization,
            kv_order=config.kv_order,
            kv_cache_dtype=config.kv_cache_torch_dtype_name,
            # a verify step is 1 + k rows a sequence (spec_decode/verify_rows.py): graphs
            # cover cuda_graph_max_batch sequences' verify rows, not that many rows
            cuda_graph_max_batch=min(config.max_num_seqs, config.cuda_graph_max_batch)
            * (1 + _num_speculative(config)),
            cuda_graphs=config.cuda_graphs,
            max_model_len=config.max_model_len,
            cpu_weight_prepack=config.cpu_weight_prepack,
            **kwargs,
        )

    def _blocks_for_memory(self, block_bytes: int, cpu_gb: float, gpu_share: float) -> int:
        if self.device.type == "cuda":
            # The share is of the whole device and counts this process's own weights only:
            # prefill and decode sharing one GPU each take their own share.
            free, total = torch.cuda.mem_get_info(self.device)
            budget = min(total * gpu_share - torch.cuda.memory_allocated(self.device), free * 0.95)
        else:
            budget = cpu_gb * 2**30
        num = int(budget // block_bytes)
        if num < 1:
            raise ModelLoadError(
                f"no memory left for the KV cache ({budget / 2**30:.2f} GiB budget); "
                "raise kv_cache_memory_gb / gpu_memory_utilization"
            )
        return num

    @torch.inference_mode()
    def execute(self, plan: StepPlan, carry: Carry | None = None) -> torch.Tensor:
        """Run one step; returns the logits [S_sampled, vocab] of sequences with ``sample``
        (``1 + num_drafts`` rows for a verify sequence; leaves the prompt logprobs of scored
        sequences in ``last_prompt_logprobs``). ``carry``: tokens of the plan that the
        step in flight sampled, read on the device (common/engine/async_steps.py)."""
        self.last_prompt_logprobs = {}
        for seq in plan.seqs:  # before any write: a prefix hit's open compressed block
            for src, dst in seq.block_copies:
                self.kv_cache[dst].copy_(self.kv_cache[src])
        plan = as_decode_rows(plan) or plan
        scored = any(s.score_next_ids for s in plan.seqs)
        if self.graphs is not None and not scored:
            logits = self.graphs.run(plan, carry)
            if logits is not None:
                self.num_graph_steps += 1
                return logits
        self.num_eager_steps += 1
        prepare = self.prepare_pcp if self.parallel.is_parallel else self.prepare
        self._score_rows = []
        input_ids, positions, meta, logits_indices = prepare(plan)
        if carry is not None:
            offsets = list(itertools.accumulate((len(s.token_ids) for s in plan.seqs), initial=0))
            carry.apply(input_ids, offsets)
        if not self._score_rows:
            return self.model(input_ids, positions, self.kv_cache, meta, logits_indices)
        rows = torch.tensor(
            [r.row for r in self._score_rows], dtype=torch.int64, device=self.device
        )
        num = logits_indices.shape[0]
        logits = self.model(input_ids, positions, self.kv_cache, meta,
                            torch.cat((logits_indices, rows)))  # fmt: skip
        self.last_prompt_logprobs = score_rows(logits[num:], self._score_rows)
        return logits[:num]

    def prepare(
        self, plan: StepPlan
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
        block_size = self.layout.block_size
        tokens: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        logits_indices: list[int] = []
        for seq in plan.seqs:
            if seq.score_next_ids:  # prompt logprobs (prompt_logprobs.py)
                self._score_rows += rows_of_piece(seq.request_id, seq.score_next_ids,
                                                  seq.score_top, 0, len(seq.token_ids),
                                                  seq.start_position, len(tokens))  # fmt: skip
            tokens += seq.token_ids
            for pos in range(seq.start_position, seq.context_len):
                positions.append(pos)
                slots.append(seq.block_ids[pos // block_size] * block_size + pos % block_size)
            if seq.sample:  # a verify step wants its drafts' positions too
                logits_indices += range(len(tokens) - 1 - seq.num_drafts, len(tokens))
        decodes = [s for s in plan.seqs if len(s.token_ids) == 1]
        prefills = plan.seqs[len(decodes) :]
        cu = [0]
        for s in prefills:
            cu.append(cu[-1] + len(s.token_ids))
        dev = self.device

        def as_tensor(values: list[int], dtype: torch.dtype = torch.int32) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype, device=dev)

        meta = AttentionMetadata(
            slot_mapping=as_tensor(slots, torch.int64),
            num_decode_tokens=len(decodes),
            decode_context_lens=as_tensor([s.context_len for s in decodes]),
            decode_block_tables=_block_tables(decodes, dev),
            prefill_cu_seqlens_q=as_tensor(cu),
            prefill_context_lens=as_tensor([s.context_len for s in prefills]),
            prefill_block_tables=_block_tables(prefills, dev),
            prefill_max_q_len=max((len(s.token_ids) for s in prefills), default=0),
            decode_splits=self._decode_splits(padded_batch(len(decodes), self._graph_max_batch)),
            k_scale=self.layout.k_scale,
            v_scale=self.layout.v_scale,
        )
        meta = with_groups(meta, plan, block_size, self.group_rates)
        return (
            as_tensor(tokens, torch.int64),
            as_tensor(positions, torch.int64),
            meta,
            as_tensor(logits_indices, torch.int64),
        )

    def _decode_splits(self, num_seqs: int) -> int:
        return self.model.decode_splits(num_seqs, self.layout.num_kv_heads, self.device)

    def prepare_pcp(
        self, plan: StepPlan
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
        """This rank's zigzag pieces of every sequence; K/V slots of all ranks' pieces.

        Each piece attends as its own pseudo-sequence (its queries are the last positions
        of a context ending at the piece's end), after every rank wrote the step's K/V.
        """
        par, block_size = self.parallel, self.layout.block_size
        tokens: list[int] = []
        positions: list[int] = []
        logits_indices: list[int] = []
        pieces: list[tuple[int, int, list[int]]] = []  # (num queries, context len, blocks)
        seq_ends: list[int] = []  # each piece's sequence's context end
        slots_of_rank: list[list[int]] = [[] for _ in range(par.pcp_size)]
        for seq in plan.seqs:
            n = len(seq.token_ids)
            for rank in range(par.pcp_size):
                for a, b in rank_pieces(n, par.pcp_size, rank):
                    span = range(seq.start_position + a, seq.start_position + b)
                    slots_of_rank[rank] += [
                        seq.block_ids[p // block_size] * block_size + p % block_size for p in span
                    ]
                    if rank != par.pcp_rank:
                        continue
                    if seq.score_next_ids:
                        self._score_rows += rows_of_piece(seq.request_id, seq.score_next_ids,
                                                          seq.score_top, a, b,
                                                          seq.start_position, len(tokens))  # fmt: skip
                    tokens += seq.token_ids[a:b]
                    positions += span
                    pieces.append((b - a, seq.start_position + b, seq.block_ids))
                    seq_ends.append(seq.context_len)
                    if seq.sample and b == n:
                        logits_indices.append(len(tokens) - 1)
        pad_to = max(len(s) for s in slots_of_rank)
        slots = [slot for s in slots_of_rank for slot in s + [-1] * (pad_to - len(s))]
        num_own = len(tokens)
        dev = self.device
        cu = [0]
        for num, _, _ in pieces:
            cu.append(cu[-1] + num)
        width = max((len(b) for _, _, b in pieces), default=0)
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            num_decode_tokens=0,
            decode_context_lens=torch.zeros(0, dtype=torch.int32, device=dev),
            decode_block_tables=torch.zeros((0, 0), dtype=torch.int32, device=dev),
            prefill_cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=dev),
            prefill_context_lens=torch.tensor(
                [c for _, c, _ in pieces], dtype=torch.int32, device=dev
            ),
            prefill_block_tables=torch.tensor(
                [b + [0] * (width - len(b)) for _, _, b in pieces], dtype=torch.int32, device=dev
            ).reshape(len(pieces), width),
            prefill_max_q_len=max((num for num, _, _ in pieces), default=0),
            kv_gather=lambda kv: par.gather_padded(kv, num_own, pad_to),
            prefill_seq_ends=torch.tensor(seq_ends, dtype=torch.int32, device=dev),
            k_scale=self.layout.k_scale,
            v_scale=self.layout.v_scale,
        )
        meta = with_groups_pcp(meta, plan, block_size, par.pcp_size, par.pcp_rank, self.group_rates)
        return (
            torch.tensor(tokens, dtype=torch.int64, device=dev),
            torch.tensor(positions, dtype=torch.int64, device=dev),
            meta,
            torch.tensor(logits_indices, dtype=torch.int64, device=dev),
        )


def _num_speculative(config: EngineConfig) -> int:
    spec = config.speculative_config
    return spec.num_speculative_tokens if spec is not None else 0


def _block_tables(seqs: list[ScheduledSeq], device: torch.device) -> torch.Tensor:
    width = max((len(s.block_ids) for s in seqs), default=0)
    rows = [s.block_ids + [0] * (width - len(s.block_ids)) for s in seqs]
    return torch.tensor(rows, dtype=torch.int32, device=device).reshape(len(seqs), width)
