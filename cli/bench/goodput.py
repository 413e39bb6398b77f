"""Goodput for ``pdserve bench serve --goodput``: SLO attainment per load and the highest
request rate a deployment serves within its SLOs, as vLLM and DistServe define them.

vLLM's definitions (``vllm bench serve --goodput ttft:MS tpot:MS e2el:MS``): a request is
good when it meets every target given; TPOT = (E2E - TTFT) / (output tokens - 1), and a
request of one output token has no TPOT, so it meets any TPOT target. A failed request
meets none. Attainment is over every request sent, failed ones included.

DistServe's (OSDI'24): the goodput of a deployment is the highest request rate at which
at least 90% of requests are good, found by sweeping the arrival rate. Between the
highest swept rate at or above 90% and the next one below it, the rate is interpolated
linearly; a sweep whose lowest rate is already below 90%, or whose highest is still at or
above it, bounds the goodput instead (``bound``). Pure functions over the per-request
records of a run's JSON (``RequestRecord.public``), so a results file can be re-scored.
"""

from __future__ import annotations

import argparse
import math
from collections import defaultdict
from typing import Any

SLO_NAMES = ("ttft", "tpot", "e2el")
TITLES = {"ttft": "TTFT", "tpot": "TPOT", "e2el": "E2E", "all": "all SLOs"}
TARGET = 0.9  # DistServe's share of good requests


def slo_item(text: str) -> tuple[str, float]:
    """One ``NAME:MS`` of --goodput (vLLM's syntax), e.g. ``ttft:500``."""
    name, sep, value = text.partition(":")
    if not sep or name not in SLO_NAMES:
        raise argparse.ArgumentTypeError(
            f"expected NAME:MS with NAME one of {', '.join(SLO_NAMES)}, got {text!r}"
        )
    try:
        ms = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{name}: {value!r} is not a number of ms") from None
    if not ms >= 0 or math.isinf(ms):
        raise argparse.ArgumentTypeError(f"{name}: the target must be >= 0 ms, got {value}")
    return name, ms


def slos_of(items: list[tuple[str, float]] | None) -> dict[str, float]:
    """--goodput's items as {name: ms}; a name given twice is an error, not a silent pick."""
    slos: dict[str, float] = {}
    for name, ms in items or ():
        if name in slos:
            raise argparse.ArgumentTypeError(f"--goodput names {name} twice")
        slos[name] = ms
    return slos


def tpot_ms(request: dict[str, Any]) -> float | None:
    """vLLM's TPOT of one request; None for one output token (no decode to time)."""
    if request["output_tokens"] <= 1:
        return None
    return (request["e2e_ms"] - request["ttft_ms"]) / (request["output_tokens"] - 1)


def meets(request: dict[str, Any], slos: dict[str, float]) -> dict[str, bool]:
    """Which targets one request (a JSON record, times in ms) meets; failed: none."""
    if not request["ok"]:
        return dict.fromkeys(slos, False)
    tpot = tpot_ms(request)
    measured = {"ttft": request["ttft_ms"], "e2el": request["e2e_ms"], "tpot": tpot}
    return {name: (name == "tpot" and tpot is None) or measured[name] <= ms
            for name, ms in slos.items()}  # fmt: skip


def attainment(requests: list[dict[str, Any]], slos: dict[str, float],
               duration_s: float) -> dict[str, Any]:  # fmt: skip
    """The share of requests meeting each target, and every one ("all"); good requests
    and good requests per second of the run (vLLM's request goodput)."""
    verdicts = [meets(r, slos) for r in requests]
    num_good = sum(all(v.values()) for v in verdicts)
    n = len(requests)
    shares = {name: sum(v[name] for v in verdicts) / n if n else 0.0 for name in slos}
    return {"slos_ms": dict(slos), "attainment": {**shares, "all": num_good / n if n else 0.0},
            "num_good": num_good, "num_requests": n,
            "good_request_rate": num_good / duration_s if duration_s > 0 else 0.0}  # fmt: skip


def goodput_rate(points: list[tuple[float, float]], target: float = TARGET) -> dict[str, Any]:
    """The highest rate with a share of good requests >= target, from (rate, share) points.

    ``bound`` says how to read ``rate``: "interpolated" (between the highest rate at or
    above target and the next swept rate, linearly in share), "above_highest" (every rate
    up to the highest swept one met it: the goodput is at least ``rate``), "below_lowest"
    (the lowest swept rate already missed it: the goodput is below ``rate``), or "none"
    (no finite rate swept). Infinite rates (all at once) have no place on the axis."""
    swept = sorted((r, s) for r, s in points if math.isfinite(r))
    if not swept:
        return {"rate": None, "bound": "none"}
    passing = [i for i, (_, share) in enumerate(swept) if share >= target]
    if not passing:
        return {"rate": swept[0][0], "bound": "below_lowest"}
    i = passing[-1]
    if i == len(swept) - 1:
        return {"rate": swept[i][0], "bound": "above_highest"}
    (r0, s0), (r1, s1) = swept[i], swept[i + 1]  # s0 >= target > s1
    return {"rate": r0 + (r1 - r0) * (s0 - target) / (s0 - s1), "bound": "interpolated"}


def describe(result: dict[str, Any], per_device: float | None = None) -> str:
    """A goodput for the table: "1.52", ">= 4.00" (met at every rate), "< 0.50" (missed
    at the lowest), each with its per-device figure when the device count is known."""
    rate, bound = result["rate"], result["bound"]
    if rate is None:
        return "- (no finite rate swept)"
    sign = {"interpolated": "", "above_highest": ">= ", "below_lowest": "< "}[bound]
    text = f"{sign}{rate:.2f}"
    return text if per_device is None else f"{text} ({sign}{per_device:.2f} per device)"


def series(runs: list[dict[str, Any]], num_devices: int | None) -> list[dict[str, Any]]:
    """One goodput per mode (and concurrency cap, when several were swept): every run of
    that mode at a finite rate is a point of its attainment curve."""
    groups: dict[tuple[str, Any], list[dict[str, Any]]] = defaultdict(list)
    for run in runs:
        if "goodput" in run:
            groups[(run["mode"], run.get("load"))].append(run)
    out = []
    for (mode, load), members in groups.items():
        members.sort(key=lambda r: _rate(r["request_rate"]))
        rates = [_rate(r["request_rate"]) for r in members]
        result = goodput_rate([(rate, r["goodput"]["attainment"]["all"])
                               for rate, r in zip(rates, members, strict=True)])  # fmt: skip
        per_device = (result["rate"] / num_devices
                      if num_devices and result["rate"] is not None else None)  # fmt: skip
        out.append({
            "mode": mode, "max_concurrency": load,
            "request_rates": [r["request_rate"] for r in members],
            "attainment": {name: [r["goodput"]["attainment"][name] for r in members]
                           for name in members[0]["goodput"]["attainment"]},
            "good_request_rate": [r["goodput"]["good_request_rate"] for r in members],
            # conditional disaggregation: the requests decode prefilled (None: no counter)
            "local_prefill_share": [r.get("metrics", {}).get("local_prefill_share")
                                    for r in members],
            "goodput_rps": result["rate"], "bound": result["bound"],
            "num_devices": num_devices, "goodput_rps_per_device": per_device,
        })  # fmt: skip
    return out


def _rate(value: float | str) -> float:
    return math.inf if value == "inf" else float(value)


def format_tables(summaries: list[dict[str, Any]], slos: dict[str, float]) -> str:
    """Attainment per mode and rate, then each mode's goodput."""
    names = [*slos, "all"]
    header = ["mode", "rate (req/s)", *(f"{TITLES[n]} ok" for n in names), "good req/s"]
    body = [[_series_name(s), str(rate), *(f"{s['attainment'][n][i]:.0%}" for n in names),
             f"{s['good_request_rate'][i]:.2f}"]
            for s in summaries for i, rate in enumerate(s["request_rates"])]  # fmt: skip
    shares = [share for s in summaries
              for share in s.get("local_prefill_share") or [None] * len(s["request_rates"])]  # fmt: skip
    if any(share is not None for share in shares):  # a column only where a mode has one
        header.append("local prefill")
        for row, share in zip(body, shares, strict=True):
            row.append("-" if share is None else f"{share:.0%}")
    targets = ", ".join(f"{TITLES[n]} <= {ms:g} ms" for n, ms in slos.items())
    rows = [[_series_name(s), describe({"rate": s["goodput_rps"], "bound": s["bound"]},
                                       s["goodput_rps_per_device"])]
            for s in summaries]  # fmt: skip
    return "\n".join([
        f"SLO attainment ({targets}; good = every target met)", *_aligned([header, *body]), "",
        f"goodput: the highest rate with >= {TARGET:.0%} of requests good, interpolated "
        "between swept rates (>= R: still met at the highest rate; < R: missed at the lowest)",
        *_aligned([["mode", "goodput (req/s)"], *rows]),
    ])  # fmt: skip


def _series_name(summary: dict[str, Any]) -> str:
    cap = summary["max_concurrency"]
    return summary["mode"] if cap is None else f"{summary['mode']} c={cap}"


def _aligned(rows: list[list[str]]) -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    out = []
    for k, row in enumerate(rows):
        first, *rest = row
        out.append("  ".join([first.ljust(widths[0]),
                              *(c.rjust(w) for c, w in zip(rest, widths[1:], strict=True))]))  # fmt: skip
        if k == 0:
            out.append("  ".join("-" * w for w in widths))
    return out
