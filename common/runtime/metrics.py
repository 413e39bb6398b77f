"""Service metrics as plain numbers, shipped to the router on scrape.

Each service keeps its own counters, gauges and histograms here (no prometheus_client in
the hot path, nothing global); the router asks every service for ``samples()`` when
``/metrics`` is scraped and renders the whole deployment with labels ``service``,
``instance`` and ``rank``.
"""

from __future__ import annotations

import bisect
import threading
from collections import defaultdict
from typing import Any

from pdserve.common.runtime.protocol import MetricSample

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0)
# TTFT parts go down to tens of microseconds (an idle handoff, the first chunk's emit)
PART_BUCKETS = (0.0001, 0.00025, 0.0005, *LATENCY_BUCKETS[:1], 0.0025, *LATENCY_BUCKETS[1:])
BUCKETS = {"pdserve:ttft_part_seconds": PART_BUCKETS}

COUNTERS = {
    "pdserve:requests": "requests finished, by finish reason",
    "pdserve:kv_transfers": "KV pulls completed",
    "pdserve:kv_transfer_bytes": "bytes of KV pulled",
    "pdserve:kv_transfer_descriptors": "NIXL descriptors of the KV pulls (one per KV head and run of blocks)",
    "pdserve:kv_transfer_failures": "KV pulls that failed",
    "pdserve:kv_handshakes": "KV handshakes with a producer epoch: ahead (before any request) or lazy (a request waited)",
    "pdserve:kv_notification_failures": "release notifications that could not be sent",
    "pdserve:kv_expired_requests": "requests whose KV lease expired before release",
    "pdserve:kv_replica_releases": "releases received by a producer rank",
    "pdserve:num_preemptions": "requests preempted for lack of KV blocks",
    "pdserve:prefix_cache_replayed_tokens": "cached prompt tokens recomputed because a sliding window lost blocks (at most the window per hit)",
    "pdserve:bad_messages": "malformed or unexpected wire messages received",
    "pdserve:kv_host_cache_hits": "prompt KV blocks a prefix lookup found in the host tier (not on the device) and copied back up",
    "pdserve:kv_host_cache_offload_bytes": "bytes of KV blocks the device pool evicted, copied down into the host tier",
    "pdserve:kv_host_cache_reload_bytes": "bytes of KV blocks copied back up from the host tier",
    "pdserve:kv_host_cache_served": "prompt KV blocks a prefill handed decode from its host tier (KVHandle.host_slots: read from host DRAM)",
    "pdserve:kv_host_tier_pull_bytes": "bytes decode read from a prefill's host tier (the tier READs of KV pulls; TP 1 decode)",
    "pdserve:kv_host_tier_pull_seconds": "seconds of those tier READs (per pull, its longest); bytes / seconds is the tier pull's speed",
    "pdserve:local_prefills": "prompts the router sent to be prefilled by their decode instance (conditional disaggregation), by reason: short (uncached part under local_prefill_threshold), prefill_behind or faster_here (the router's measured TTFT of both paths)",
    "pdserve:peer_down": "times the router found an instance down (silent or disconnected)",
    "pdserve:router_lost": "times a service found a router gone and aborted its requests",
    "pdserve:requests_refused": "requests refused at admission, by reason (overloaded, draining)",
    "pdserve:kv_forged_messages": "releases and heartbeats refused: they lacked the KV handle's token",
    "pdserve:request_timeouts": "requests the router failed because a phase passed its deadline, by phase",
    "pdserve:loop_stalls": "times this process's event loop woke later than its ping interval (its own stall)",
    "pdserve:service_restarts": "times `pdserve up` started a failed service again (its launcher's report)",
    "pdserve:auth_failures": "ZeroMQ handshakes refused: unknown CURVE key, no CURVE, wrong server key",
    "pdserve:spec_decode_num_drafts": "speculative verify steps of a sequence (each proposes k tokens)",
    "pdserve:spec_decode_num_draft_tokens": "draft tokens proposed",
    "pdserve:spec_decode_num_accepted_tokens": "draft tokens accepted",
    "pdserve:spec_decode_num_accepted_tokens_per_pos": "draft tokens accepted at each draft position",
    "pdserve:abandoned_tokens": "tokens computed for requests then given up (aborted: client gone, deadline, abort): nobody was waiting for them",
    "pdserve:client_served_tokens": "tokens served per client class (prompt tokens dispatched, tokens generated); the first max_client_classes clients seen have a class each, the rest are 'other'",
    "pdserve:model_steps": "model steps by kind: graph (a decode step replayed from a captured CUDA graph) or eager (anything else: a prefill chunk among the decodes, a batch past cuda_graph_max_batch, CPU)",
    "pdserve:spec_decode_num_deferred": "verify steps without drafts: the DSpark draft's state was being rebuilt",
}
GAUGES = {
    "pdserve:kv_blocks_free": "free KV blocks",
    "pdserve:kv_blocks_total": "KV blocks in the pool",
    "pdserve:kv_host_cache_blocks": "KV blocks held in the host tier under the prefix cache",
    "pdserve:kv_host_cache_blocks_total": "KV blocks the host tier can hold (kv_host_cache_gb)",
    "pdserve:num_requests_running": "requests running",
    "pdserve:num_requests_waiting": "requests waiting",
    "pdserve:service_down": "1 while `pdserve up` has the service down: waiting to restart it, or not restarting it",
    "pdserve:loop_lag_seconds": "how late the event loop's periodic task last woke (beyond its interval)",
    "pdserve:unreachable_producers": "prefill instances a decode (peer) last reported it cannot pull from (a partition); the router pairs it with others meanwhile",
}
HISTOGRAMS = {
    "pdserve:time_to_first_token_seconds": "time from arrival to the first token",
    "pdserve:inter_token_latency_seconds": "time between consecutive tokens",
    "pdserve:e2e_request_latency_seconds": "time from arrival to the last token",
    "pdserve:kv_transfer_seconds": "time of one KV pull",
    "pdserve:client_queue_seconds": "time a request waited at the router for a dispatch slot, per client class",
    "pdserve:ttft_part_seconds": "time to first token by part of the request's path (common/runtime/ttft.py)",
}
HELP = {**COUNTERS, **GAUGES, **HISTOGRAMS}
MAX_CACHED_KEYS = 4096  # Metrics._key's cache, emptied when full

Labels = tuple[tuple[str, str], ...]


class Histogram:
    def __init__(self, bounds: tuple[float, ...] = LATENCY_BUCKETS) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value

    def cumulative(self) -> list[tuple[float, float]]:
        out, total = [], 0
        for bound, count in zip((*self.bounds, float("inf")), self.counts, strict=True):
            total += count
            out.append((bound, float(total)))
        return out


class Metrics:
    def __init__(self, service: str, instance: int | str) -> None:
        self.base = {"service": service, "instance": str(instance)}
        self.counters: dict[tuple[str, Labels], float] = defaultdict(float)
        self.gauges: dict[tuple[str, Labels], float] = {}
        self.histograms: dict[tuple[str, Labels], Histogram] = {}
        self._lock = threading.Lock()  # the engine thread writes while the loop reads
        self._keys: dict[tuple[Any, ...], tuple[str, Labels]] = {}  # _key's answers

    def _key(self, name: str, labels: dict[str, str | int]) -> tuple[str, Labels]:
        # cached: the router observes a metric or two per token of every stream
        asked = (name, *labels.items())
        key = self._keys.get(asked)
        if key is None:
            if name not in HELP:
                raise KeyError(f"unknown metric {name}")
            merged = {"rank": "0", **self.base, **{k: str(v) for k, v in labels.items()}}
            key = name, tuple(sorted(merged.items()))
            if len(self._keys) >= MAX_CACHED_KEYS:
                self._keys.clear()
            self._keys[asked] = key
        return key

    def inc(self, name: str, amount: float = 1.0, **labels: str | int) -> None:
        key = self._key(name, labels)
        with self._lock:
            self.counters[key] += amount

    def declare(self, *names: str, **labels: str | int) -> None:
        """Show counters at 0 before their first event, so dashboards see them exist."""
        for name in names:
            self.inc(name, 0.0, **labels)

    def set(self, name: str, value: float, **labels: str | int) -> None:
        key = self._key(name, labels)
        with self._lock:
            self.gauges[key] = value

    def observe(self, name: str, value: float, **labels: str | int) -> None:
        key = self._key(name, labels)
        with self._lock:
            hist = self.histograms.get(key)
            if hist is None:
                hist = self.histograms[key] = Histogram(BUCKETS.get(name, LATENCY_BUCKETS))
            hist.observe(value)

    def value(self, name: str, **labels: str | int) -> float:
        key = self._key(name, labels)
        return self.counters.get(key, self.gauges.get(key, 0.0))

    def samples(self) -> list[MetricSample]:
        with self._lock:
            return self._samples()

    def _samples(self) -> list[MetricSample]:
        out = [MetricSample(n, "counter", dict(lb), v) for (n, lb), v in self.counters.items()]
        out += [MetricSample(n, "gauge", dict(lb), v) for (n, lb), v in self.gauges.items()]
        out += [
            MetricSample(n, "histogram", dict(lb), 0.0, h.cumulative(), h.sum)
            for (n, lb), h in self.histograms.items()
        ]
        return out


def render(samples: list[MetricSample]) -> bytes:
    """Prometheus text exposition of samples from every service (counters get _total)."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.core import (
        CounterMetricFamily,
        GaugeMetricFamily,
        HistogramMetricFamily,
    )

    families: dict[str, object] = {}
    label_names = ["service", "instance", "rank"]
    for s in samples:
        names = label_names + sorted(k for k in s.labels if k not in label_names)
        fam = families.get(s.name)
        if fam is None:
            kind = {
                "counter": CounterMetricFamily,
                "gauge": GaugeMetricFamily,
                "histogram": HistogramMetricFamily,
            }[s.kind]
            fam = families[s.name] = kind(s.name, HELP.get(s.name, s.name), labels=names)
        values = [s.labels.get(k, "") for k in names]
        if s.kind == "histogram":
            buckets = [("+Inf" if b == float("inf") else repr(b), c) for b, c in s.buckets]
            fam.add_metric(values, buckets, s.sum)  # type: ignore[attr-defined]
        else:
            fam.add_metric(values, s.value)  # type: ignore[attr-defined]

    class _Collector:
        def collect(self) -> object:
            return iter(families.values())

    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Collector())  # type: ignore[arg-type]
    return generate_latest(registry)
