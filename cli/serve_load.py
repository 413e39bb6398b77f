"""The pure parts of ``pdserve bench serve``'s load: seeded prompts, Poisson arrivals, one
record per request and vLLM's serving metrics over them. Shared by ``bench_serve.py`` and
``bench_serve_hf.py`` (the Hugging Face reference), which import nothing from each other."""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any


def make_prompts(n: int, input_len: int, id_range: tuple[int, int], seed: int,
                 stream: str = "prompts") -> list[list[int]]:  # fmt: skip
    """Seeded random token ids; distinct, so that none can hit the prefix cache. The length
    is part of the seed: with one seed, the prompts of a longer run would otherwise begin
    with those of a shorter one (prompt k of 2L tokens = prompts 2k and 2k + 1 of L), and a
    server that outlives one run (a peer) would serve the next one's prefixes from its
    cache."""
    rng = random.Random(f"{seed}/{stream}/{input_len}")  # a string seed: stable across processes
    low, high = id_range
    prompts = [[rng.randrange(low, high) for _ in range(input_len)] for _ in range(n)]
    if len({tuple(p) for p in prompts}) != n:  # only possible with a tiny --input-len
        raise RuntimeError("random prompts collided; use a longer --input-len")
    return prompts


def arrival_offsets(n: int, rate: float, seed: int) -> list[float]:
    """Seconds from the start at which each request is sent: a Poisson process (as vLLM's
    burstiness 1), or all at 0 for an infinite rate. The first request goes at 0."""
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(f"{seed}/arrivals")
    offsets = [0.0]
    for _ in range(n - 1):
        offsets.append(offsets[-1] + rng.expovariate(rate))
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
        "cached_prompt_tokens": sum(r.cached_tokens for r in done),
        "request_throughput": len(done) / duration_s,
        "output_throughput": output_tokens / duration_s,
        "total_token_throughput": (input_tokens + output_tokens) / duration_s,
        **stats("ttft", [r.ttft_s for r in done if r.ttft_s is not None]),
        **stats("tpot", tpot),
        **stats("itl", [gap for r in done for gap in r.itl_s]),
        **stats("e2el", [r.e2e_s for r in done if r.e2e_s is not None]),
    }
