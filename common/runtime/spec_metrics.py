"""Speculative decoding's acceptance counters on a service's metrics (vLLM's meanings:
``num_drafts`` verify steps of a sequence, ``num_draft_tokens`` proposed in them,
``num_accepted_tokens`` accepted, and per draft ``position`` the accepted ones there)."""

from __future__ import annotations

from typing import Any

from pdserve.common.runtime.metrics import Metrics

TOTALS = {
    "pdserve:spec_decode_num_drafts": "num_drafts",
    "pdserve:spec_decode_num_draft_tokens": "num_draft_tokens",
    "pdserve:spec_decode_num_accepted_tokens": "num_accepted_tokens",
    "pdserve:spec_decode_num_deferred": "num_deferred",
}
PER_POS = "pdserve:spec_decode_num_accepted_tokens_per_pos"


class SpecDecodeReporter:
    """Adds what an engine's ``SpecDecodeStats`` gained since the last call."""

    def __init__(self, metrics: Metrics, stats: Any) -> None:
        self.metrics = metrics
        self.stats = stats  # common/engine/spec_decode/stats.py (the runtime imports no torch)
        self._seen: dict[tuple[str, int], int] = {}
        metrics.declare(*TOTALS)
        for pos in range(len(stats.accepted_per_pos)):
            metrics.declare(PER_POS, position=pos)

    def report(self) -> None:
        for name, attr in TOTALS.items():
            self._add(name, -1, getattr(self.stats, attr))
        for pos, value in enumerate(self.stats.accepted_per_pos):
            self._add(PER_POS, pos, value)

    def _add(self, name: str, pos: int, value: int) -> None:
        delta = value - self._seen.get((name, pos), 0)
        if delta > 0:
            labels = {} if pos < 0 else {"position": pos}
            self.metrics.inc(name, delta, **labels)
            self._seen[name, pos] = value
