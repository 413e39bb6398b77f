"""TTFT by part for ``pdserve bench serve``: the router's ``pdserve:ttft_part_seconds``
histograms (common/runtime/ttft.py), scraped from ``/metrics`` before and after a load, differenced.

The mean of a part is exact (histogram sum / count); its median is interpolated inside
the histogram's buckets (metrics.PART_BUCKETS: 0.1 ms .. 60 s), as Prometheus'
histogram_quantile does. Parts are measured by the deployment, from the request's arrival
at the router to the router's receipt of the first chunk, so they add up to the router's
TTFT, not to the client's (which adds HTTP and the client's own loop).
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import TYPE_CHECKING, Any

from pdserve.common.runtime.ttft import PARTS

if TYPE_CHECKING:
    import aiohttp

FAMILY = "pdserve:ttft_part_seconds"
LOCAL_FAMILY = "pdserve:local_prefills"

# part -> (count, sum, {upper bound: cumulative count})
Snapshot = dict[str, tuple[float, float, dict[float, float]]]


def parse(text: str) -> Snapshot:
    """The ttft part histograms of one /metrics page, summed over instances."""
    from prometheus_client.parser import text_string_to_metric_families

    counts: dict[str, float] = defaultdict(float)
    sums: dict[str, float] = defaultdict(float)
    buckets: dict[str, dict[float, float]] = defaultdict(lambda: defaultdict(float))
    for family in text_string_to_metric_families(text):
        if family.name != FAMILY:
            continue
        for sample in family.samples:
            part = sample.labels.get("part", "")
            if sample.name.endswith("_bucket"):
                buckets[part][float(sample.labels["le"])] += sample.value
            elif sample.name.endswith("_sum"):
                sums[part] += sample.value
            elif sample.name.endswith("_count"):
                counts[part] += sample.value
    return {part: (counts[part], sums[part], dict(buckets[part])) for part in counts}


def quantile(q: float, cumulative: dict[float, float]) -> float | None:
    """Linear interpolation inside the bucket holding the q-th observation."""
    bounds = sorted(cumulative)
    if not bounds or cumulative[bounds[-1]] <= 0:
        return None
    rank = q * cumulative[bounds[-1]]
    lower, below = 0.0, 0.0
    for bound in bounds:
        count = cumulative[bound]
        if count >= rank and count > below:
            if math.isinf(bound):
                return lower
            return lower + (bound - lower) * (rank - below) / (count - below)
        lower, below = bound, count
    return lower


def part_metrics(before: Snapshot, after: Snapshot) -> dict[str, float | None]:
    """``mean_ttft_<part>_ms`` and ``median_ttft_<part>_ms`` of the requests in between."""
    out: dict[str, float | None] = {}
    for part in PARTS:
        count, total, buckets = after.get(part, (0.0, 0.0, {}))
        count0, total0, buckets0 = before.get(part, (0.0, 0.0, {}))
        n = count - count0
        delta = {b: c - buckets0.get(b, 0.0) for b, c in buckets.items()}
        out[f"mean_ttft_{part}_ms"] = (total - total0) / n * 1e3 if n > 0 else None
        # a part that was 0 every time (handshake, connected ahead) has no spread to guess
        median = None if n <= 0 else 0.0 if total == total0 else quantile(0.5, delta)
        out[f"median_ttft_{part}_ms"] = None if median is None else median * 1e3
    return out


async def scrape(session: aiohttp.ClientSession, url: str) -> Snapshot:
    """The router's part histograms now; empty when /metrics is unavailable."""
    return parse(await scrape_text(session, url))


async def scrape_text(session: aiohttp.ClientSession, url: str) -> str:
    """The router's /metrics page now; "" when it is unavailable."""
    try:
        async with session.get(f"{url}/metrics") as resp:
            return await resp.text() if resp.status == 200 else ""
    except Exception:  # noqa: BLE001 - parts are extra: a run without them is still a run
        return ""


TIER_BYTES = "pdserve:kv_host_tier_pull_bytes"
TIER_SECONDS = "pdserve:kv_host_tier_pull_seconds"


def counter_total(text: str, family_name: str) -> float:
    """A counter of one /metrics page, summed over its labels (instances)."""
    from prometheus_client.parser import text_string_to_metric_families

    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        if family.name == family_name
        for sample in family.samples
        if sample.name.endswith("_total")
    )


def tier_pull(before: str, after: str) -> dict[str, float | None]:
    """The load's reads of host-tier slots by decode (a disaggregated deployment with
    ``kv_host_cache_gb``): bytes, and GB/s over the tier READs' own seconds; None where no
    tier block was read (or the server has no such counter)."""
    moved = counter_total(after, TIER_BYTES) - counter_total(before, TIER_BYTES)
    seconds = counter_total(after, TIER_SECONDS) - counter_total(before, TIER_SECONDS)
    if moved <= 0:
        return {"tier_pull_bytes": None, "tier_pull_gbps": None}
    return {
        "tier_pull_bytes": moved,
        "tier_pull_gbps": moved / seconds / 1e9 if seconds > 0 else None,
    }


def local_prefills(text: str) -> float:
    """``pdserve:local_prefills_total`` of one /metrics page, every reason summed (prompts
    the decode instances prefilled themselves: services/router/local_prefill.py)."""
    from prometheus_client.parser import text_string_to_metric_families

    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        if family.name == LOCAL_FAMILY
        for sample in family.samples
        if sample.name.endswith("_total")
    )


def local_share(before: str, after: str, num_requests: int) -> float | None:
    """The share of a load's requests prefilled on their decode instance; None from a
    server without the counter (colocated pdserve, where decode prefills every prompt, or
    a peer)."""
    if LOCAL_FAMILY not in after or num_requests <= 0:
        return None
    return (local_prefills(after) - local_prefills(before)) / num_requests


def table_rows(runs: list[dict[str, Any]]) -> list[list[str]]:
    """One "mean / median" row per part that any run measured."""
    rows = []
    for part in PARTS:
        cells = []
        for run in runs:
            mean, median = (run["metrics"].get(f"{s}_ttft_{part}_ms") for s in ("mean", "median"))
            cells.append("-" if mean is None or median is None else f"{mean:.1f} / {median:.1f}")
        if any(c != "-" for c in cells):
            rows.append([f"TTFT {part} mean / median (ms)", *cells])
    return rows
