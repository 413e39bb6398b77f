"""The plan of one model step: what the scheduler hands to every model runner.

A msgspec Struct so a coordinator can broadcast it to rank processes unchanged.
"""

from __future__ import annotations

import msgspec


class ScheduledSeq(msgspec.Struct, array_like=True, frozen=True):
    request_id: str
    token_ids: list[int]  # the tokens computed this step
    start_position: int  # position of token_ids[0]
    block_ids: list[int]  # the whole block table of the sequence
    sample: bool  # the step ends at the sequence's last token: sample the next
    # Prompt logprobs: token_ids[k]'s row scores next_ids[k] (the next prompt token) for
    # k < len(score_next_ids), with score_top alternatives (common/engine/prompt_logprobs.py)
    score_next_ids: list[int] = []
    score_top: int = 0
    # Speculative decoding: the last ``num_drafts`` tokens are drafts; the step returns
    # logits at the last ``1 + num_drafts`` positions (verify), not only the last.
    num_drafts: int = 0
    # The block tables of KV cache groups 1.. (common/engine/kv_groups.py); group 0's is
    # block_ids. Empty when the cache is one group.
    group_block_ids: list[list[int]] = []
    # Blocks to copy (source, destination) before the step writes anything: a prefix hit's
    # open block of a compressed group (common/engine/group_tables.py).
    block_copies: list[tuple[int, int]] = []

    def table(self, group: int) -> list[int]:
        return self.block_ids if group == 0 else self.group_block_ids[group - 1]

    @property
    def context_len(self) -> int:
        return self.start_position + len(self.token_ids)


class StepPlan(msgspec.Struct, array_like=True, frozen=True):
    # Decode sequences (one token each) come first, then prefill chunks and verify steps.
    seqs: list[ScheduledSeq]

    @property
    def num_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.seqs)

    @property
    def num_logits(self) -> int:
        """Rows of logits a runner returns: ``1 + num_drafts`` per sampled sequence."""
        return sum(1 + s.num_drafts for s in self.seqs if s.sample)
