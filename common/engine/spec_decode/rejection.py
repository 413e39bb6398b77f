"""Acceptance of drafted tokens (pure torch): the rejection sampling of Leviathan et al.
and Chen et al., which keeps the target model's distribution exact.

Draft ``d_i`` is accepted with probability ``min(1, p_i(d_i) / q_i(d_i))``; at the first
rejection the next token is drawn from ``norm(max(0, p_i - q_i))``; when all ``K`` are
accepted a bonus token is drawn from ``p_K``. A draft that is a point mass (n-gram, a
greedy draft model) has ``q_i(d_i) = 1``: accept with probability ``p_i(d_i)``, resample
from ``p_i`` without ``d_i``. A greedy target is the one-hot ``p``: accept while equal.
"""

from __future__ import annotations

import torch


def rejection_sample(
    target_probs: torch.Tensor,  # [B, K+1, V]
    draft_ids: torch.Tensor,  # [B, K] int64
    draft_probs: torch.Tensor | None,  # [B, K, V]; None: every draft a point mass
    uniforms: torch.Tensor,  # [B, K] in [0, 1)
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row: how many drafts are accepted [B] and the token that follows them [B]
    (the resampled one at the first rejection, else the bonus)."""
    num_rows, k = draft_ids.shape
    picked = draft_ids.unsqueeze(-1)  # [B, K, 1]
    p_draft = target_probs[:, :k].gather(-1, picked).squeeze(-1)  # [B, K]
    if draft_probs is None:
        ratio = p_draft
    else:
        q_draft = draft_probs.gather(-1, picked).squeeze(-1)  # [B, K]; > 0: drawn from q
        ratio = p_draft / q_draft.clamp_min(torch.finfo(q_draft.dtype).tiny)
    accepted = uniforms < ratio  # [B, K]; u < min(1, r) == u < r for u < 1
    num_accepted = accepted.to(torch.int64).cumprod(-1).sum(-1)  # [B]
    rows = torch.arange(num_rows, device=target_probs.device)
    dist = target_probs[rows, num_accepted].clone()  # [B, V]
    rejected = num_accepted < k  # [B]
    if k and bool(rejected.any()):
        at = num_accepted.clamp(max=k - 1)
        if draft_probs is None:
            residual = dist.scatter(-1, draft_ids[rows, at].unsqueeze(-1), 0.0)
        else:
            residual = (dist - draft_probs[rows, at]).clamp_min(0.0)
        # p == q exactly leaves nothing (a rejection then has probability 0; rounding can
        # still get here): p itself is the right law of the next token.
        empty = residual.sum(-1, keepdim=True) <= 0
        residual = torch.where(empty, dist, residual)
        dist = torch.where(rejected.unsqueeze(-1), residual, dist)
    next_tokens = torch.multinomial(dist, 1, generator=generator).squeeze(-1)  # [B]
    return num_accepted, next_tokens
