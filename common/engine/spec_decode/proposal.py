"""What a proposer hands the verify step."""

from __future__ import annotations

from typing import NamedTuple

import torch


class Draft(NamedTuple):
    token_ids: list[int]  # [d]
    # [d, V]: the distribution each draft was drawn from; None: point masses (n-gram, a
    # greedy draft model), so acceptance needs only the target's probabilities
    probs: torch.Tensor | None = None
