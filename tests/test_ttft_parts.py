"""TTFT parts (common/runtime/ttft.py) and their scrape for ``bench serve`` (cli/bench/ttft_parts.py), on
synthetic marks and a synthetic /metrics page: no services, no timing."""

from __future__ import annotations

import pytest

from pdserve.cli.bench.ttft_parts import parse, part_metrics, quantile, table_rows
from pdserve.common.runtime.metrics import Metrics, render
from pdserve.common.runtime.ttft import MARKS, PARTS, ttft_parts


def test_parts_telescope_to_the_router_ttft() -> None:
    marks = {name: 100.0 + i * (i + 1) / 1000 for i, name in enumerate(MARKS)}
    parts = ttft_parts(marks)
    assert list(parts) == list(PARTS)
    assert sum(parts.values()) == pytest.approx(marks["router_first_chunk"] - marks["arrived"])
    assert parts["queue"] == pytest.approx(0.002) and parts["return"] == pytest.approx(0.016)


def test_missing_marks_drop_only_their_parts_and_skew_is_clamped() -> None:
    # colocated: no prefill or pull marks; a decode host whose clock runs behind
    marks = {
        "arrived": 10.0,
        "decode_received": 9.9,
        "first_chunk": 10.2,
        "router_first_chunk": 10.3,
    }
    assert ttft_parts(marks) == pytest.approx({"return": 0.1})
    marks.update(handshake_done=9.9, pull_started=9.95, pull_done=10.05)
    parts = ttft_parts(marks)
    assert parts["handshake"] == 0.0 and parts["pull"] == pytest.approx(0.1)
    assert "queue" not in parts and "handoff" not in parts


def _page(observations: dict[str, list[float]]) -> str:
    metrics = Metrics("router", 0)
    for part, values in observations.items():
        for value in values:
            metrics.observe("pdserve:ttft_part_seconds", value, part=part)
    return render(metrics.samples()).decode()


def test_part_metrics_difference_two_scrapes() -> None:
    before = parse(_page({"pull": [0.5]}))
    after = parse(_page({"pull": [0.5, 0.003, 0.003, 0.004], "queue": [0.0002]}))
    assert after["pull"][0] == 4
    out = part_metrics(before, after)
    assert out["mean_ttft_pull_ms"] == pytest.approx(10 / 3)
    assert 2.5 <= out["median_ttft_pull_ms"] <= 5.0  # inside the (2.5 ms, 5 ms] bucket
    assert out["mean_ttft_queue_ms"] == pytest.approx(0.2)
    assert out["mean_ttft_handshake_ms"] is None and out["median_ttft_handshake_ms"] is None
    zero = part_metrics({}, parse(_page({"handshake": [0.0, 0.0]})))
    assert zero["mean_ttft_handshake_ms"] == zero["median_ttft_handshake_ms"] == 0.0
    rows = table_rows([{"metrics": out}, {"metrics": {}}])
    assert [r[0].split()[1] for r in rows] == ["queue", "pull"]
    assert rows[1][2] == "-"


def test_quantile_interpolates_inside_a_bucket() -> None:
    cumulative = {0.001: 0.0, 0.002: 10.0, float("inf"): 10.0}
    assert quantile(0.5, cumulative) == pytest.approx(0.0015)
    assert quantile(0.5, {float("inf"): 0.0}) is None
    assert quantile(0.99, {0.001: 1.0, float("inf"): 3.0}) == 0.001
