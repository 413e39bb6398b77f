"""The pure parts of ``pdserve bench serve``'s load: seeded prompts and their lengths
(fixed, or lognormal with a long tail), Poisson or bursty arrivals, one record per request
and vLLM's serving metrics over them. Shared by ``bench_serve.py`` and
``bench_serve_hf.py`` (the Hugging Face reference), which import nothing from each other."""

from __future__ import annotations

import math
import random
import statistics
import zlib
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True)
class Load:
    """One load of a sweep: its arrival rate (inf: all at once) and concurrency cap."""

    rate: float
    concurrency: int | None

    def name(self, mode: str, loads: list[Load]) -> str:
        """``mode``, plus what varies across the sweep: ``disaggregated r=2 c=8``."""
        parts = [mode]
        if len({load.rate for load in loads}) > 1:
            parts.append(f"r={self.rate:g}")
        if len({load.concurrency for load in loads}) > 1:
            parts.append(f"c={self.concurrency or 'inf'}")
        return " ".join(parts)


@dataclass(frozen=True)
class Workload:
    """Prompt and output lengths: every request ``input_len`` / ``output_len`` tokens
    (fixed), or drawn from lognormals whose medians they are (lognormal), with shape
    ``*_sigma`` (the log's standard deviation) and capped at ``max_*_len``: chat traffic's
    long tail (most requests short, a few many times the median)."""

    dist: str = "fixed"
    input_len: int = 256
    output_len: int = 64
    input_sigma: float = 1.0
    output_sigma: float = 1.0
    max_input_len: int | None = None  # None: 8x the median (~2% of draws clipped at sigma 1)
    max_output_len: int | None = None
    turns: int = 1  # > 1: multi-turn conversations (``conversations``), input_len a new message

    @property
    def input_cap(self) -> int:
        return self.max_input_len or 8 * self.input_len

    @property
    def output_cap(self) -> int:
        return self.max_output_len or 8 * self.output_len

    @property
    def longest(self) -> int:
        """The most tokens one request can need (prompt + output)."""
        if self.dist == "fixed":
            return self.input_len + self.output_len
        return self.input_cap + self.output_cap

    def lengths(self, n: int, seed: int) -> list[tuple[int, int]]:
        """(prompt tokens, output tokens) of each request; seeded, and the same for every
        load of a sweep (one seed), so rates differ only in their arrivals."""
        if self.dist == "fixed":
            return [(self.input_len, self.output_len)] * n
        rng = random.Random(f"{seed}/lengths")

        def draw(median: int, sigma: float, cap: int) -> int:
            return min(cap, max(1, round(rng.lognormvariate(math.log(median), sigma))))

        return [(draw(self.input_len, self.input_sigma, self.input_cap),
                 draw(self.output_len, self.output_sigma, self.output_cap))
                for _ in range(n)]  # fmt: skip


def make_prompts(n: int, input_len: int, id_range: tuple[int, int], seed: int,
                 stream: str = "prompts") -> list[list[int]]:  # fmt: skip
    """``n`` prompts of ``input_len`` tokens (prompts_of_lengths)."""
    return prompts_of_lengths([input_len] * n, id_range, seed, stream)


def prompts_of_lengths(lengths: list[int], id_range: tuple[int, int], seed: int,
                       stream: str = "prompts") -> list[list[int]]:  # fmt: skip
    """Seeded random token ids; distinct, so that none can hit the prefix cache. The
    lengths are part of the seed: with one seed, the prompts of a longer run would
    otherwise begin with those of a shorter one (prompt k of 2L tokens = prompts 2k and
    2k + 1 of L), and a server that outlives one run (a peer) would serve the next one's
    prefixes from its cache."""
    if len(set(lengths)) <= 1:  # fixed lengths: the seeds (and prompts) of earlier results
        key = str(lengths[0] if lengths else 0)
    else:
        key = f"{len(lengths)}x{zlib.crc32(repr(lengths).encode()):08x}"
    rng = random.Random(f"{seed}/{stream}/{key}")  # a string seed: stable across processes
    low, high = id_range
    prompts = [[rng.randrange(low, high) for _ in range(length)] for length in lengths]
    if len({tuple(p) for p in prompts}) != len(prompts):  # only possible with tiny prompts
        raise RuntimeError("random prompts collided; use longer prompts (--input-len)")
    return prompts


def conversations(lengths: list[tuple[int, int]], turns: int, id_range: tuple[int, int],
                  seed: int) -> tuple[list[list[int]], list[int | None]]:  # fmt: skip
    """Multi-turn chats (``--multi-turn``), where a host tier pays: ``ceil(n / turns)``
    users, interleaved turn by turn (request i is turn ``i // users`` of user
    ``i % users``). A turn's prompt is the user's previous prompt, then a stand-in for the
    previous answer (seeded ids of that answer's length: the streamed API returns text, not
    token ids, and a chat client re-tokenizes text anyway), then a new message of the
    turn's prompt length. Returns the prompts and, per request, the request it must wait
    for (its user's previous turn; None for a first turn)."""
    users = -(-len(lengths) // turns)
    messages = prompts_of_lengths([i for i, _ in lengths], id_range, seed, "messages")
    answers = prompts_of_lengths([o for _, o in lengths], id_range, seed, "answers")
    prompts: list[list[int]] = []
    after: list[int | None] = []
    for i in range(len(lengths)):
        prev = i - users if i >= users else None
        history = [] if prev is None else prompts[prev] + answers[prev]
        prompts.append(history + messages[i])
        after.append(prev)
    return prompts, after


def prompt_lengths(lengths: list[tuple[int, int]], turns: int) -> list[int]:
    """The prompt tokens each request sends: its length, or with ``turns`` > 1 its
    conversation so far (``conversations``: earlier prompts' messages and answers, then its
    own message)."""
    users = -(-len(lengths) // turns)
    sent: list[int] = []
    for i, (new, _) in enumerate(lengths):
        prev = i - users if i >= users else None
        sent.append(new if prev is None else sent[prev] + lengths[prev][1] + new)
    return sent


WARMUP_MIN_LEN = 16  # the shortest length bucket a warm-up reaches
WARMUP_MAX_BURST = 64  # the largest burst without a concurrency cap
WARMUP_OUTPUT_LEN = 8  # decode steps per warm-up request (a burst's decode batch sizes)


def warmup_plan(num: int, prompt_lens: list[int], output_len: int,
                max_burst: int) -> list[list[tuple[int, int]]]:  # fmt: skip
    """The warm-up of a deployment before it is measured (``--num-warmups``): phases of
    (prompt tokens, output tokens), each phase's requests sent at once, so that every kernel
    shape the load reaches is compiled before the clock starts (Triton compiles per shape
    class; a lognormal load reaches many):

    - per length bucket, the powers of two from ``WARMUP_MIN_LEN`` up to the longest prompt
      of the load, then that longest one: ``num`` requests one at a time, of the bucket's
      length, one token less, two less... (both sides of the kernels' divisibility
      specialisations);
    - per batch size, 2, 4, ... up to ``max_burst``: ``num`` bursts of that many concurrent
      requests of the load's median prompt length (prefill batches and decode batches of
      that size).

    Empty when ``num`` is 0."""
    if num <= 0 or not prompt_lens:
        return []
    longest = max(prompt_lens)
    # (at least 4 tokens: a burst's random prompts must differ)
    median = max(4, sorted(prompt_lens)[len(prompt_lens) // 2])
    out = max(1, min(output_len, WARMUP_OUTPUT_LEN))
    buckets, size = [], WARMUP_MIN_LEN
    while size < longest:
        buckets.append(size)
        size *= 2
    buckets.append(longest)
    phases = [[(max(1, b - j), out)] for b in buckets for j in range(num)]
    burst = 2
    while burst <= max_burst:
        phases += [[(median, out)] * burst for _ in range(num)]
        burst *= 2
    return phases


def arrival_offsets(n: int, rate: float, seed: int, burstiness: float = 1.0) -> list[float]:
    """Seconds from the start at which each request is sent, as vLLM's bench sends them:
    gaps drawn from a gamma distribution of shape ``burstiness`` and mean 1 / rate (shape
    1 is a Poisson process; below 1 burstier, above 1 more even), or all at 0 for an
    infinite rate. The first request goes at 0. The draws depend on the seed and shape,
    not on the rate: a sweep's rates share one arrival pattern, compressed."""
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(f"{seed}/arrivals")
    offsets = [0.0]
    for _ in range(n - 1):
        offsets.append(offsets[-1] + rng.gammavariate(burstiness, 1.0) / (burstiness * rate))
    return offsets[:n]


@dataclass
class RequestRecord:
    index: int
    ok: bool = False
    error: str | None = None
    start_s: float = 0.0  # when sent, from the start of the run
    prompt_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0
    ttft_s: float | None = None
    e2e_s: float | None = None
    itl_s: list[float] = field(default_factory=list)

    def public(self) -> dict[str, Any]:
        """The JSON record: times in ms, no per-gap list (it is in the pooled ITL)."""
        out = asdict(self)
        for key in ("start_s", "ttft_s", "e2e_s"):
            value = out.pop(key)
            out[key.replace("_s", "_ms")] = None if value is None else value * 1e3
        out["chunks"] = len(out.pop("itl_s")) + (1 if self.ttft_s is not None else 0)
        return out


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default, which vLLM uses)."""
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


STATS: dict[str, Callable[[list[float]], float]] = {
    "mean": statistics.fmean, "median": statistics.median,
    "p90": lambda v: percentile(v, 90), "p99": lambda v: percentile(v, 99),
}  # fmt: skip


def stats(name: str, seconds: list[float]) -> dict[str, float | None]:
    ms = [s * 1e3 for s in seconds]
    # No values (TPOT of one-token outputs, or nothing completed): None, not a fake 0.
    return {f"{stat}_{name}_ms": fn(ms) if ms else None for stat, fn in STATS.items()}


def compute_metrics(records: list[RequestRecord], duration_s: float) -> dict[str, Any]:
    """vLLM's serving metrics over the completed requests of one run."""
    done = [r for r in records if r.ok]
    input_tokens = sum(r.prompt_tokens for r in done)
    output_tokens = sum(r.output_tokens for r in done)
    cached_tokens = sum(r.cached_tokens for r in done)
    tpot = [
        (r.e2e_s - r.ttft_s) / (r.output_tokens - 1)
        for r in done
        if r.output_tokens > 1 and r.e2e_s is not None and r.ttft_s is not None
    ]
    return {
        "completed": len(done),
        "failed": len(records) - len(done),
        "duration_s": duration_s,
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "cached_prompt_tokens": cached_tokens,
        # the share of prompt tokens the prefix cache served (device or host tier)
        "prefix_hit_rate": cached_tokens / input_tokens if input_tokens else 0.0,
        "request_throughput": len(done) / duration_s,
        "output_throughput": output_tokens / duration_s,
        "total_token_throughput": (input_tokens + output_tokens) / duration_s,
        **stats("ttft", [r.ttft_s for r in done if r.ttft_s is not None]),
        **stats("tpot", tpot),
        **stats("itl", [gap for r in done for gap in r.itl_s]),
        **stats("e2el", [r.e2e_s for r in done if r.e2e_s is not None]),
    }
