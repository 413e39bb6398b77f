"""Fair decode batches (#49): where a bigger decode step no longer buys throughput, run a
busy client's sequences in smaller steps, round robin, so another client's token waits
for a small step, not for the busy client's whole batch.

On a CPU a decode step costs about linearly more with the batch past a small size
(compute-bound: the embedded model on 2 threads, ~65 ms at batch 1, ~150 ms at 16,
~0.5 s at 56), so throughput (batch / step time) saturates early: 16 sequences a step
give ~95% of what 56 do, at a third of the step. On a GPU a step of 64 costs about what a
step of 1 does (memory-bound, CUDA graphs): throughput grows with the batch and no smaller
step pays.

``DecodeCurve`` learns that curve from the engine's own decode steps: an exponential
moving average of step time (and of the batch, which varies within a bucket) per batch
bucket (the CUDA graph sizes on CUDA, so a capped step replays a captured graph; the same
ladder on CPU). ``cap(n)`` is, for ``n`` sequences decoding, the smallest bucket ``s < n``
whose throughput is at least the share asked (below; the cap in use: 3 points less) of the
full batch's (``n``'s bucket: well sampled, what the cap costs the busy client; a max over
the smaller buckets' few samples would be noise) AND whose step takes at most
``time_ratio`` (0.8) of ``n``'s step; None where no bucket qualifies, where the full batch
is not measured yet, or ``n`` is small. The buckets are walked from ``n``'s down, as far as
the first whose throughput falls under ``descent`` (80%) of the full batch's. A GPU-like
curve (step time nearly flat) never meets both: a bucket with 80-90% of the throughput is
nearly the full batch and takes nearly its time.

The share asked follows from a budget: the cap may cost the busy client ``budget`` (10%)
of its decode throughput over time, and it costs only while another client decodes. So
with ``presence`` the share of recent decode time (an exponential average over ~``tau``,
20 s) in which more than one client decoded, a bucket must keep ``1 - budget /
presence`` of the full batch's throughput, at most ``share`` (90%: two clients always
present) and at least ``descent``. Issue 49's case on a 2-core CPU (a short request every
2 s beside a burst, present ~half the time) asks ~80% and takes 24 where 90% took 32.

The small buckets are measured by probes: while more than one client decodes, one step
in ``probe_every`` runs at the next bucket down from the full batch that lacks fresh
samples, as far as the descent goes (so on a GPU it costs a few steps at the one or two
buckets below the full batch per ``refresh_steps``). The full batch is re-measured the
same way (an uncapped step) when its samples age.

Config: ``[engine] fair_decode_batch`` = "auto" (this), "off" (never), or N (a fixed cap
while more than one client decodes; docs/operations.md). Pure: no torch, no clock; the
engine core feeds ``observe`` with its steps' times (engine_core.py), the scheduler asks
``cap`` (scheduler.py).
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass

# the ladder of buckets (CUDA's graph sizes, with 12 between 8 and 16 for the CPU)
LADDER = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)


def parse_mode(value: str | int) -> str | int:
    """``fair_decode_batch`` as given: "auto", "off" or a positive int (also as text)."""
    if isinstance(value, bool):
        raise ValueError(f"fair_decode_batch must be auto, off or a positive int, got {value!r}")
    if isinstance(value, int):
        if value < 1:
            raise ValueError(f"fair_decode_batch must be auto, off or >= 1, got {value}")
        return value
    text = value.strip().lower()
    if text in ("auto", "off"):
        return text
    if text.isdigit() and int(text) >= 1:
        return int(text)
    raise ValueError(f"fair_decode_batch must be auto, off or a positive int, got {value!r}")


def ladder(max_num_seqs: int, sizes: Sequence[int] = ()) -> list[int]:
    """Buckets up to ``max_num_seqs`` (included): ``sizes`` (CUDA graph sizes) when given,
    with LADDER's past them."""
    top = max(sizes, default=0)
    out = set(sizes) | {s for s in LADDER if s > top}
    return sorted({s for s in out if s < max_num_seqs} | {max_num_seqs})


@dataclass
class Bucket:
    seconds: float = 0.0  # EMA of a step's time
    batch: float = 0.0  # EMA of the step's sequences
    samples: int = 0
    last: int = 0  # the observation count when it was last observed

    @property
    def throughput(self) -> float:
        return self.batch / self.seconds if self.seconds > 0 else 0.0


class DecodeCurve:
    def __init__(
        self,
        sizes: Sequence[int],
        share: float = 0.9,
        hold: float = 0.03,
        time_ratio: float = 0.8,
        descent: float = 0.8,
        alpha: float = 0.25,
        min_samples: int = 4,
        min_batch: int = 8,
        probe_every: int = 2,
        refresh_steps: int = 1000,
        budget: float = 0.1,
        tau: float = 20.0,
    ) -> None:
        self.sizes = sorted(set(sizes))
        self.share = share
        self.time_ratio = time_ratio
        self.hold = hold
        self.current: int | None = None  # the last cap given
        self.descent = descent  # buckets are measured down to one under this share of the best
        self.alpha = alpha
        self.min_samples = min_samples
        self.min_batch = min_batch  # below it, no cap (nothing to gain)
        self.probe_every = probe_every
        self.refresh_steps = refresh_steps
        self.budget = budget
        self.tau = tau
        # the share of recent decode time with more than one client decoding; 1 until seen
        self.presence = 1.0
        self.buckets: dict[int, Bucket] = {}
        self.observed = 0  # decode steps observed
        self._since_probe = 0

    def bucket_of(self, n: int) -> int:
        """The bucket a step of ``n`` sequences counts in: the smallest size >= n."""
        i = bisect_left(self.sizes, n)
        return self.sizes[i] if i < len(self.sizes) else n

    def observe(self, n: int, seconds: float, shared: bool = True) -> None:
        """A decode step of ``n`` sequences took ``seconds``; ``shared``: more than one
        client decoded in it."""
        if n < 1 or seconds <= 0:
            return
        self.presence += (1.0 - math.exp(-seconds / self.tau)) * (float(shared) - self.presence)
        self.observed += 1
        b = self.buckets.setdefault(self.bucket_of(n), Bucket())
        if b.samples == 0:
            b.seconds, b.batch = seconds, float(n)
        else:
            b.seconds += self.alpha * (seconds - b.seconds)
            b.batch += self.alpha * (n - b.batch)
        b.samples += 1
        b.last = self.observed

    def summary(self) -> dict[int, tuple[float, float, int]]:
        """Per bucket: (step ms, tokens/s, samples), for the log."""
        return {
            s: (round(b.seconds * 1e3, 1), round(b.throughput, 1), b.samples)
            for s, b in sorted(self.buckets.items())
        }

    def _fresh(self, size: int) -> Bucket | None:
        b = self.buckets.get(size)
        if b is None or b.samples < self.min_samples:
            return None
        if self.observed - b.last > self.refresh_steps:
            return None
        return b

    def _known(self, size: int) -> Bucket | None:
        b = self.buckets.get(size)
        return b if b is not None and b.samples >= self.min_samples else None

    def _rungs(self, n: int) -> list[int]:
        """The buckets below ``n``'s (at least ``min_batch``), largest first."""
        top = self.bucket_of(n)
        return [s for s in reversed(self.sizes) if s < top and s < n and s >= self.min_batch]

    def share_asked(self) -> float:
        """The share of the full batch's throughput a capped step must keep (module
        docstring): the budget spread over the time the cap is in force."""
        presence = max(self.presence, self.budget)  # no presence: the descent's share
        return min(self.share, max(self.descent, 1.0 - self.budget / presence))

    def cap(self, n: int) -> int | None:
        """The batch to step ``n`` decoding sequences in (module docstring); None: all."""
        if n <= self.min_batch:
            return None
        full = self._known(self.bucket_of(n))
        if full is None:
            return None
        best = full.throughput  # the full batch's: what the cap may cost (not a noisy max)
        asked = self.share_asked()
        chosen = None
        for size in self._rungs(n):  # from the top down, as far as the descent goes
            b = self._known(size)
            if b is None:
                break
            if b.throughput < self.descent * best:
                break
            # the cap in use keeps its place within ``hold`` of the share (no flapping on
            # the step times' noise)
            share = asked - (self.hold if size == self.current else 0.0)
            if b.throughput >= share * best and b.seconds <= self.time_ratio * full.seconds:
                chosen = size
        self.current = chosen
        return chosen

    def probe(self, n: int) -> int | None:
        """A batch to run this step at to measure it (None: none now). ``n`` sequences
        decode; call once a step while more than one client decodes."""
        if n <= self.min_batch:
            return None
        self._since_probe += 1
        if self._since_probe < self.probe_every:
            return None
        top = self.bucket_of(n)
        if self._fresh(top) is None:
            if self._known(top) is None:
                return None  # the full batch measures itself (no cap until it is known)
            self._since_probe = 0
            return n  # re-measure the full batch: an uncapped step
        best = self.buckets[top].throughput
        for size in self._rungs(n):
            b = self._fresh(size)
            if b is None:
                self._since_probe = 0
                return size
            if b.throughput < self.descent * best:
                return None  # the descent stops here
        return None
