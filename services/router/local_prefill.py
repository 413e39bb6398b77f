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

- ``faster_here``: both paths have been measured (``PathModel``: the router's own time
  from this choice to the first token of recent requests on each path, against the
  backlog they met) and decode's predicted TTFT for this prompt is the lower one.

Backlogs are in prompt tokens. Until both paths are measured, a token of prefill is taken
to cost the same on either kind of instance (``prefill_behind``); once they are, what the
router measured decides (``faster_here``, or the prefill instance): on one GPU the two
processes share, a handover costs a pull and a hop between processes, and a prefill
process's tokens may run slower than decode's own (time-slicing), neither of which token
counts alone see. A ``threshold`` of 0 turns every local prefill off. Pure: the router hands
in what its links know (services/router/links.py) and what it measured; tests drive it with
numbers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

SHORT = "short"
PREFILL_BEHIND = "prefill_behind"
FASTER_HERE = "faster_here"
REASONS = (SHORT, PREFILL_BEHIND, FASTER_HERE)
LOCAL, REMOTE = "local", "remote"  # the two paths a prompt's prefill takes


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


MIN_SAMPLES = 4  # observations a path needs before its predictions are used
FORGET = 0.9  # each older observation's weight, per newer one: ~the last 10 count
# below this spread of the work sizes seen (variance / mean^2: a standard deviation of 10%
# of the mean), a path's overhead and speed cannot be told apart
MIN_SPREAD = 0.01


@dataclass
class PathModel:
    """One path's time to first token (from the router's choice) as a line in the tokens
    it had to compute first (its backlog then, plus the prompt's uncached part): ``overhead
    + work * seconds_per_token``, fitted by least squares over recent observations, each
    older one weighted ``FORGET`` times less. The overhead is what a path pays whatever
    the work (a handover's hops and pull); the slope its speed under the load of late."""

    forget: float = FORGET
    num: int = 0
    # exponentially weighted sums: weights, x, y, x^2, x*y
    sums: list[float] = field(default_factory=lambda: [0.0] * 5)

    def observe(self, work_tokens: int, seconds: float) -> None:
        x, y = float(work_tokens), float(seconds)
        self.sums = [s * self.forget + v for s, v in zip(self.sums, (1.0, x, y, x * x, x * y),
                                                         strict=True)]  # fmt: skip
        self.num += 1

    @property
    def spread(self) -> bool:
        """Work sizes varied enough to tell overhead from speed."""
        w, sx, _, sxx, _ = self.sums
        return sx > 0 and (w * sxx - sx * sx) / (sx * sx) >= MIN_SPREAD

    def fit(self, slope_hint: float | None = None) -> tuple[float, float] | None:
        """(overhead s, seconds per token), both >= 0; None before ``MIN_SAMPLES``. Work
        sizes too alike to fit a slope (``spread``): ``slope_hint`` (the other path's, a
        token costing the same on either) with the rest as overhead, else a line through 0."""
        if self.num < MIN_SAMPLES:
            return None
        w, sx, sy, sxx, sxy = self.sums
        if not self.spread:
            if slope_hint is not None:
                return max(0.0, (sy - slope_hint * sx) / w), slope_hint
            return 0.0, (sy / sx if sx > 0 else 0.0)
        spread = w * sxx - sx * sx
        slope = max(0.0, (w * sxy - sx * sy) / spread)
        overhead = (sy - slope * sx) / w
        if overhead < 0:  # the line would cross 0 above no work: through 0 instead
            return 0.0, max(0.0, sxy / sxx)
        return overhead, slope

    def predict(self, work_tokens: int, slope_hint: float | None = None) -> float | None:
        fit = self.fit(slope_hint)
        return None if fit is None else fit[0] + fit[1] * work_tokens


@dataclass
class PathModels:
    """What the router measured of both paths (``PathModel`` each)."""

    local: PathModel = field(default_factory=PathModel)
    remote: PathModel = field(default_factory=PathModel)

    def observe(self, path: str, work_tokens: int, seconds: float) -> None:
        (self.local if path == LOCAL else self.remote).observe(work_tokens, seconds)

    def predict(self, path: str, work_tokens: int) -> float | None:
        """``path``'s TTFT for ``work_tokens``; a path whose work sizes were too alike takes
        the other's speed, when that one's is known."""
        model, other = (self.local, self.remote) if path == LOCAL else (self.remote, self.local)
        fit = other.fit() if other.spread else None
        return model.predict(work_tokens, None if fit is None else fit[1])


def remote_work(prefills: Sequence[PrefillBacklog]) -> int | None:
    """The fewest tokens a live prefill instance would compute before this prompt's first
    token (its backlog plus the prompt's uncached part there); None without one."""
    return min((b.num_queued_tokens + b.num_uncached_tokens for b in prefills), default=None)


def local_reason(
    threshold: int,
    num_local_uncached: int,
    num_local_queued: int,
    prefills: Sequence[PrefillBacklog],
    measured: PathModels | None = None,
) -> str | None:
    """Why the prompt is prefilled on its decode instance (one of ``REASONS``), or None:
    it goes to a prefill instance. ``num_local_uncached``: its tokens the decode instance
    would compute; ``num_local_queued``: prompt tokens of local prefills that decode holds
    and has not yet given a first token for; ``prefills``: every live prefill instance;
    ``measured``: the paths' TTFT models (``PathModels``), used once both have samples."""
    if threshold <= 0:
        return None
    if num_local_uncached < threshold:
        return SHORT
    local = num_local_queued + num_local_uncached
    remote = remote_work(prefills)
    if remote is None:
        return None
    if measured is not None:
        here, there = measured.predict(LOCAL, local), measured.predict(REMOTE, remote)
        if here is not None and there is not None:
            return FASTER_HERE if here < there else None
    if all(b.num_queued_tokens + b.num_uncached_tokens > local for b in prefills):
        return PREFILL_BEHIND
    return None
