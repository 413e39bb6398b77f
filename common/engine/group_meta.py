"""The attention metadata of KV cache groups 1.. of a step (common/engine/kv_groups.py).

A step's tokens, positions and context lengths are the same for every group; what differs
is where each token's K/V goes (``slot_mapping``) and the block tables. The runners build
group 0's metadata as they always did; these functions add the other groups' from each
sequence's ``ScheduledSeq.table(g)``, in the same token order. A compressed group
(``rates[g]`` > 1: its slots are entries, which the model writes itself) gets no slot
mapping; with one, every group gets the step's sequences and their tables
(``AttentionMetadata.seq_spans``, ``seq_block_tables``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from pdserve.common.engine.step_plan import StepPlan
from pdserve.common.model.layers.attention import AttentionMetadata
from pdserve.common.parallel.zigzag import rank_pieces


def num_groups_of(plan: StepPlan) -> int:
    return 1 + max((len(s.group_block_ids) for s in plan.seqs), default=0)


def _slots(table: list[int], start: int, stop: int, block_size: int) -> list[int]:
    return [table[p // block_size] * block_size + p % block_size for p in range(start, stop)]


def _tables(rows: list[list[int]], device: torch.device) -> torch.Tensor:
    width = max((len(r) for r in rows), default=0)
    padded = [r + [0] * (width - len(r)) for r in rows]
    return torch.tensor(padded, dtype=torch.int32, device=device).reshape(len(rows), width)


def _with_seqs(
    metas: list[AttentionMetadata], plan: StepPlan, rates: Sequence[int]
) -> list[AttentionMetadata]:
    if all(r == 1 for r in rates):
        return metas
    spans = tuple((s.start_position, s.context_len) for s in plan.seqs)
    dev = metas[0].slot_mapping.device
    return [
        dataclasses.replace(
            m, seq_spans=spans, seq_block_tables=_tables([s.table(g) for s in plan.seqs], dev)
        )
        for g, m in enumerate(metas)
    ]


def _rate(rates: Sequence[int], group: int) -> int:
    return rates[group] if rates else 1


def with_groups(
    meta: AttentionMetadata, plan: StepPlan, block_size: int, rates: Sequence[int] = ()
) -> AttentionMetadata:
    """``meta`` (group 0's, of ``ModelRunner.prepare``: decodes first, then prefill
    chunks) with the metadata of every other group of the plan's sequences (``rates``:
    each group's tokens per slot; none: all 1)."""
    num = num_groups_of(plan)
    if num == 1:
        return meta
    dev = meta.slot_mapping.device
    nd = meta.num_decode_tokens
    decodes, prefills = plan.seqs[:nd], plan.seqs[nd:]
    groups = []
    for g in range(1, num):
        slots = [
            slot
            for s in plan.seqs
            if _rate(rates, g) == 1
            for slot in _slots(s.table(g), s.start_position, s.context_len, block_size)
        ]
        groups.append(
            dataclasses.replace(
                meta,
                slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
                decode_block_tables=_tables([s.table(g) for s in decodes], dev),
                prefill_block_tables=_tables([s.table(g) for s in prefills], dev),
            )
        )
    first, *rest = _with_seqs([meta, *groups], plan, rates)
    return dataclasses.replace(first, groups=tuple(rest))


def with_groups_pcp(
    meta: AttentionMetadata,
    plan: StepPlan,
    block_size: int,
    pcp_size: int,
    pcp_rank: int,
    rates: Sequence[int] = (),
) -> AttentionMetadata:
    """``with_groups`` for ``ModelRunner.prepare_pcp``'s metadata: slots of every rank's
    zigzag pieces, each rank's list padded with -1 to the longest; one table per own piece."""
    num = num_groups_of(plan)
    if num == 1:
        return meta
    dev = meta.slot_mapping.device
    groups = []
    for g in range(1, num):
        of_rank: list[list[int]] = [[] for _ in range(pcp_size)]
        pieces: list[list[int]] = []
        for seq in plan.seqs:
            table: list[int] = seq.table(g)
            for rank in range(pcp_size):
                for a, b in rank_pieces(len(seq.token_ids), pcp_size, rank):
                    start = seq.start_position
                    if _rate(rates, g) == 1:
                        of_rank[rank] += _slots(table, start + a, start + b, block_size)
                    if rank == pcp_rank:
                        pieces.append(table)
        pad_to = max(len(s) for s in of_rank)
        slots = [slot for s in of_rank for slot in s + [-1] * (pad_to - len(s))]
        groups.append(
            dataclasses.replace(
                meta,
                slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
                prefill_block_tables=_tables(pieces, dev),
            )
        )
    first, *rest = _with_seqs([meta, *groups], plan, rates)
    return dataclasses.replace(first, groups=tuple(rest))
