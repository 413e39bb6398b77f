"""Conditional disaggregation: whether a prompt is prefilled where it will be decoded.

The router decides, before a prompt moves anywhere (docs/operations.md, "Conditional
disaggregation", says why the router and not the decode instance). A prompt is prefilled
on its decode instance (the same path as a colocated deployment's: a ``DecodeRequest``
without a KV handle, which the decode engine computes itself) when either

- ``short``: the part of it that decode has not cached is under ``threshold`` tokens: the
  handover (a prefill queue, a KV pull, the hops between processes) costs more than
  computing it among the decodes; or
- ``prefill_behind``: every live prefill instance has more tokens to compute before it
  would have this prompt's first token than the decode instance would (its own local
  prefills in flight plus this prompt's uncached part).

Backlogs are in prompt tokens: a token of prefill costs about the same on either kind of
instance (same model, same device). A ``threshold`` of 0 turns both off. Pure: the router
hands in what its links know (services/router/links.py); tests drive it with numbers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

SHORT = "short"
PREFILL_BEHIND = "prefill_behind"
REASONS = (SHORT, PREFILL_BEHIND)


@dataclass(frozen=True)
class PrefillBacklog:
    """One live prefill instance as the router sees it for one prompt."""

    num_queued_tokens: int  # prompt tokens it holds and has not answered yet
    num_uncached_tokens: int  # of this prompt, the tokens it would compute


def uncached_tokens(num_prompt_tokens: int, num_cached_blocks: int, block_size: int) -> int:
    """The prompt's tokens past its cached full blocks; the last token is always computed
    (its logits give the first token), so at least 1."""
    cached = min(num_cached_blocks * block_size, num_prompt_tokens - 1)
    return num_prompt_tokens - max(cached, 0)


def local_reason(
    threshold: int,
    num_local_uncached: int,
    num_local_queued: int,
    prefills: Sequence[PrefillBacklog],
) -> str | None:
    """Why the prompt is prefilled on its decode instance (one of ``REASONS``), or None:
    it goes to a prefill instance. ``num_local_uncached``: its tokens the decode instance
    would compute; ``num_local_queued``: prompt tokens of local prefills that decode holds
    and has not yet given a first token for; ``prefills``: every live prefill instance."""
    if threshold <= 0:
        return None
    if num_local_uncached < threshold:
        return SHORT
    local = num_local_queued + num_local_uncached
    if prefills and all(b.num_queued_tokens + b.num_uncached_tokens > local for b in prefills):
        return PREFILL_BEHIND
    return None
