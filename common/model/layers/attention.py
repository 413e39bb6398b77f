"""Per-step attention metadata: where each token's K/V goes and what each query sees.

The flat batch of a step holds the decode tokens first (one per sequence), then the
prefill chunks, so one attention layer makes at most two kernel calls.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from pdserve import kernels


@dataclass(frozen=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64: block_id * block_size + offset of each token
    num_decode_tokens: int
    decode_context_lens: torch.Tensor  # [S_d] int32
    decode_block_tables: torch.Tensor  # [S_d, max_blocks] int32
    prefill_cu_seqlens_q: torch.Tensor  # [S_p + 1] int32, offsets into the prefill tokens
    prefill_context_lens: torch.Tensor  # [S_p] int32
    prefill_block_tables: torch.Tensor  # [S_p, max_blocks] int32
    # the longest prefill query run, known on the host (the GPU kernel sizes its grid by it;
    # None: it reads it from prefill_cu_seqlens_q, a device-to-host sync in every layer)
    prefill_max_q_len: int | None = None
    # Context parallelism: gathers this rank's new K/V [2, T, H_kv, D] from every rank, in
    # the order ``slot_mapping`` describes; None when one rank computes everything.
    kv_gather: Callable[[torch.Tensor], torch.Tensor] | None = None
    # kernels.decode_splits of the decode batch as a CUDA graph would pad it: an eager step
    # and a replayed graph then sum each softmax in the same order. None: of the batch as is.
    decode_splits: int | None = None
    # fp8 KV caches: the per-tensor scales of K and V (KVLayout.k_scale / v_scale).
    k_scale: float = 1.0
    v_scale: float = 1.0
    # KV cache groups 1.. (common/engine/kv_groups.py): the same step with each group's
    # slot_mapping and block tables; this object is group 0's. Empty: one group.
    groups: tuple[AttentionMetadata, ...] = ()
    # Caches with compressed groups (DeepSeek-V4): the step's sequences in plan order, not
    # PCP pieces: (first position, end) of each, and this group's block table of each (the
    # per-sequence state beyond a window is updated from them on every rank).
    seq_spans: tuple[tuple[int, int], ...] = ()
    seq_block_tables: torch.Tensor | None = None  # [S, max_blocks] int32
    # PCP: the context end of the sequence each prefill run is a piece of (its context
    # length stops at the piece's end); what a query's lightning indexer ranks over
    # (kernels.indexer_topk row_keys). None: prefill_context_lens (a run is a sequence).
    prefill_seq_ends: torch.Tensor | None = None  # [S_p] int32

    def seq_ends(self) -> torch.Tensor:
        """[S_d + S_p]: the context end, at this step's end, of the sequence each decode
        row and prefill run belongs to (rows of cat(decode, prefill) block tables)."""
        pre = self.prefill_context_lens if self.prefill_seq_ends is None else self.prefill_seq_ends
        dec = self.decode_context_lens[: self.num_decode_tokens]
        return torch.cat((dec.to(pre.device).long(), pre.long()))

    def of_group(self, group: int) -> AttentionMetadata:
        return self if group == 0 else self.groups[group - 1]

    @property
    def num_prefills(self) -> int:
        return int(self.prefill_context_lens.shape[0])


def paged_attention(
    q: torch.Tensor,  # [T, H_q, D]
    k: torch.Tensor,  # [T, H_kv, D]
    v: torch.Tensor,  # [T, H_kv, D]
    layer_cache: torch.Tensor,  # [N, 2, H_kv, B, D]
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None,
) -> torch.Tensor:  # [T, H_q, D]
    if meta.kv_gather is not None:
        # Every rank writes every new token's K/V: all PCP ranks hold an equal replica.
        kv = meta.kv_gather(torch.stack((k, v)))  # [2, T_all, H_kv, D]
        k, v = kv[0], kv[1]
    kernels.write_kv(layer_cache, k, v, meta.slot_mapping, meta.k_scale, meta.v_scale)
    nd = meta.num_decode_tokens
    if q.shape[0] == 0:  # a PCP rank with no piece of this step still joins the gather
        return torch.empty_like(q)

    def decode(q_d: torch.Tensor) -> torch.Tensor:
        return kernels.decode_attention(
            q_d,
            layer_cache,
            meta.decode_context_lens,
            meta.decode_block_tables,
            scale,
            sliding_window,
            meta.decode_splits,
            meta.k_scale,
            meta.v_scale,
        )

    if meta.num_prefills == 0:
        return decode(q)
    prefill = kernels.prefill_attention(
        q[nd:],
        layer_cache,
        meta.prefill_cu_seqlens_q,
        meta.prefill_context_lens,
        meta.prefill_block_tables,
        scale,
        sliding_window,
        meta.k_scale,
        meta.v_scale,
        meta.prefill_max_q_len,
    )
    if nd == 0:
        return prefill
    out = torch.empty_like(q)
    out[:nd] = decode(q[:nd])
    out[nd:] = prefill
    return out
