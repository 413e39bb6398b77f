"""A verify step as a decode step: each of a sequence's ``1 + num_drafts`` positions becomes
its own one-token row over the same block table, with the context ending at that position.

The rows attend exactly as the verify's causal queries would (each layer writes every row's
K/V before attending), through the decode kernel: no host sync, fixed shape per batch, so
CUDA graphs of decode steps (common/engine/cuda_graphs.py) replay verify steps too, and the
logits come out of the same kernel as a step without speculation.
"""

from __future__ import annotations

from pdserve.common.engine.step_plan import ScheduledSeq, StepPlan


def as_decode_rows(plan: StepPlan) -> StepPlan | None:
    """``plan`` with every verify sequence split into one-token rows (logits rows in the
    same order: a sequence's positions consecutive); None when the plan has no verify or
    holds anything else than decodes and verifies (prefill chunks run as they are)."""
    if not any(s.num_drafts for s in plan.seqs):
        return None
    if not all(s.sample and len(s.token_ids) == 1 + s.num_drafts for s in plan.seqs):
        return None
    rows = [
        ScheduledSeq(
            s.request_id,
            [token],
            s.start_position + i,
            s.block_ids,
            True,
            group_block_ids=s.group_block_ids,
        )  # fmt: skip
        for s in plan.seqs
        for i, token in enumerate(s.token_ids)
    ]
    return StepPlan(rows)
