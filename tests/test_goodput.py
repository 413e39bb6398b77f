"""Goodput arithmetic (cli/bench/goodput.py) against hand-computed requests: vLLM's good request
(every target met; TPOT = (E2E - TTFT) / (output tokens - 1), none for one token) and
DistServe's goodput (the highest swept rate with >= 90% good, interpolated)."""

from __future__ import annotations

import argparse
import math
from typing import Any

import pytest

from pdserve.cli.bench.goodput import (
    attainment,
    describe,
    format_tables,
    goodput_rate,
    meets,
    series,
    slo_item,
    slos_of,
)


def req(ttft: float, e2e: float, out: int, ok: bool = True) -> dict[str, Any]:
    return {"ok": ok, "ttft_ms": ttft if ok else None, "e2e_ms": e2e if ok else None,
            "output_tokens": out if ok else 0}  # fmt: skip


# TTFT <= 100 ms, TPOT <= 20 ms, E2E <= 500 ms; each request's TPOT by hand
REQUESTS = [
    req(80, 80 + 9 * 15, 10),  # TPOT 15: meets all
    req(120, 120 + 9 * 20, 10),  # TTFT 120 misses; TPOT exactly 20 meets
    req(50, 50 + 3 * 30, 4),  # TPOT 30 misses
    req(90, 90, 1),  # one token: no TPOT, so it meets the TPOT target; meets all
    req(100, 100 + 99 * 5, 100),  # TTFT exactly 100 meets, TPOT 5; E2E 595 misses
    req(0, 0, 0, ok=False),  # failed: meets none
]
SLOS = {"ttft": 100.0, "tpot": 20.0, "e2el": 500.0}


def test_a_request_is_good_when_it_meets_every_target() -> None:
    assert [meets(r, SLOS) for r in REQUESTS] == [
        {"ttft": True, "tpot": True, "e2el": True},
        {"ttft": False, "tpot": True, "e2el": True},
        {"ttft": True, "tpot": False, "e2el": True},
        {"ttft": True, "tpot": True, "e2el": True},
        {"ttft": True, "tpot": True, "e2el": False},
        {"ttft": False, "tpot": False, "e2el": False},
    ]


def test_attainment_counts_every_request_sent() -> None:
    got = attainment(REQUESTS, SLOS, duration_s=4.0)
    assert got["attainment"] == pytest.approx(
        {"ttft": 4 / 6, "tpot": 4 / 6, "e2el": 4 / 6, "all": 2 / 6}
    )
    assert (got["num_good"], got["num_requests"]) == (2, 6)
    assert got["good_request_rate"] == pytest.approx(0.5)  # 2 good in 4 s
    # only the targets given count: without e2el, request 4 is good too
    two = attainment(REQUESTS, {"ttft": 100.0, "tpot": 20.0}, duration_s=4.0)
    assert two["attainment"]["all"] == pytest.approx(3 / 6) and "e2el" not in two["attainment"]
    assert attainment([], SLOS, 1.0)["attainment"]["all"] == 0.0


def test_goodput_interpolates_around_the_90_percent_crossing() -> None:
    # 95% at 1 req/s, 70% at 2: 1 + (0.95 - 0.9) / (0.95 - 0.7) = 1.2
    points = [(0.5, 1.0), (1.0, 0.95), (2.0, 0.7), (4.0, 0.2)]
    assert goodput_rate(points) == {"rate": pytest.approx(1.2), "bound": "interpolated"}
    # any order; an infinite rate (all at once) has no place on the axis
    shuffled = [(2.0, 0.7), (math.inf, 0.1), (1.0, 0.95), (4.0, 0.2)]
    assert goodput_rate(shuffled)["rate"] == pytest.approx(1.2)
    # not monotonic (noise): the highest rate at or above 90%, then the next one
    bumpy = [(1.0, 0.95), (2.0, 0.85), (3.0, 0.92), (4.0, 0.5)]
    assert goodput_rate(bumpy)["rate"] == pytest.approx(3 + 0.02 / 0.42)
    assert goodput_rate([(1.0, 0.9), (2.0, 0.5)])["rate"] == pytest.approx(1.0)  # >= 90% counts


def test_goodput_says_when_the_sweep_does_not_bracket_it() -> None:
    assert goodput_rate([(1.0, 0.8), (2.0, 0.5)]) == {"rate": 1.0, "bound": "below_lowest"}
    assert goodput_rate([(1.0, 1.0), (2.0, 0.91)]) == {"rate": 2.0, "bound": "above_highest"}
    assert goodput_rate([(math.inf, 1.0)]) == {"rate": None, "bound": "none"}
    assert describe({"rate": 1.0, "bound": "below_lowest"}) == "< 1.00"
    assert describe({"rate": 2.0, "bound": "above_highest"}, 1.0) == ">= 2.00 (>= 1.00 per device)"
    assert describe({"rate": 1.25, "bound": "interpolated"}) == "1.25"


def run(mode: str, rate: float | str, share: float) -> dict[str, Any]:
    good = {"attainment": {"ttft": 1.0, "tpot": share, "all": share}, "good_request_rate": 0.0}
    return {"mode": mode, "load": None, "request_rate": rate, "goodput": good}


def test_series_is_one_goodput_per_mode_per_device() -> None:
    runs = [run("disaggregated", 2.0, 0.7), run("disaggregated", 1.0, 0.95),
            run("colocated", 1.0, 0.5), run("colocated", "inf", 0.1),
            {"mode": "HF generate", "load": None, "metrics": {}}]  # fmt: skip
    dis, col = series(runs, num_devices=2)
    assert dis["mode"] == "disaggregated" and dis["request_rates"] == [1.0, 2.0]  # sorted
    assert dis["attainment"]["all"] == [0.95, 0.7]
    assert dis["goodput_rps"] == pytest.approx(1.2) and dis["bound"] == "interpolated"
    assert dis["goodput_rps_per_device"] == pytest.approx(0.6)
    assert col["request_rates"] == [1.0, "inf"] and col["bound"] == "below_lowest"
    assert series(runs, num_devices=None)[0]["goodput_rps_per_device"] is None
    table = format_tables([dis, col], {"ttft": 500.0, "tpot": 50.0})
    assert "TTFT <= 500 ms, TPOT <= 50 ms" in table
    assert "1.20 (0.60 per device)" in table and "< 1.00 (< 0.50 per device)" in table
    assert "95%" in table and "70%" in table


def test_goodput_flag_takes_vllms_syntax() -> None:
    assert slo_item("ttft:500") == ("ttft", 500.0) and slo_item("e2el:1.5") == ("e2el", 1.5)
    for bad in ("ttft", "itl:5", "tpot:-1", "tpot:fast", "ttft:inf"):
        with pytest.raises(argparse.ArgumentTypeError):
            slo_item(bad)
    assert slos_of([("ttft", 1.0), ("tpot", 2.0)]) == {"ttft": 1.0, "tpot": 2.0}
    with pytest.raises(argparse.ArgumentTypeError, match="ttft twice"):
        slos_of([("ttft", 1.0), ("ttft", 2.0)])
