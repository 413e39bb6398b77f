"""Acceptance counters with vLLM's meanings (its SpecDecodingStats)."""

from __future__ import annotations


class SpecDecodeStats:
    """Totals since start: ``num_drafts`` verify steps of a sequence, ``num_draft_tokens``
    tokens proposed in them, ``num_accepted_tokens`` of those accepted, and per draft
    position the number accepted there (non-increasing: position i is accepted only
    after positions < i were). A verify step that went to the target without drafts (the
    DSpark confidence head doubted the first, or its draft state was still being rebuilt)
    is no draft; ``num_deferred`` counts those of the second kind."""

    def __init__(self, k: int) -> None:
        self.num_deferred = 0
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_pos = [0] * k

    def add(self, num_draft_tokens: int, num_accepted: int) -> None:
        if num_draft_tokens == 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        for pos in range(num_accepted):
            self.accepted_per_pos[pos] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens emitted per verify step (accepted + the one the target adds)."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0
