"""The summary of ``benchmarks/gpu.sh pd-one-gpu`` (issue #48): goodput by mode for each
`bench serve --compare` run (each order of the modes, each --gpu-share), the ratios the
issue asks for, and the host-tier multi-turn runs' TTFT beside each other.

    python benchmarks/pd_one_gpu.py --goodput A.json B.json ... --tier T0.json T12.json

Each goodput JSON is one `bench serve --compare --goodput ...` (its modes in the order it
started them); each tier JSON one `bench serve --compare --multi-turn N` run. Reads the
JSONs only (no GPU, no pdserve import), prints tables, writes nothing.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

MODES = ("colocated", "disaggregated", "conditional")


def _fmt(value: float | None, spec: str = "{:.2f}") -> str:
    return "-" if value is None else spec.format(value)


def _interval(rps: float | None, bound: str | None) -> tuple[float, float] | None:
    """What a goodput figure says: below the lowest rate measured is (0, rate), above the
    highest is (rate, inf), otherwise the value itself."""
    if rps is None:
        return None
    if bound == "below_lowest":
        return (0.0, rps)
    if bound == "above_highest":
        return (rps, float("inf"))
    return (rps, rps)


def _ratio(num: tuple[float, float] | None, den: tuple[float, float] | None) -> str:
    """num / den where either may be a bound: '1.40', '< 1.00', '> 1.20' or '?' (unknown)."""
    if num is None or den is None or den[1] == 0:
        return "-"
    lo = num[0] / den[1] if den[1] != float("inf") else 0.0
    hi = num[1] / den[0] if den[0] > 0 else float("inf")
    if lo == hi:
        return f"{lo:.2f}"
    if hi != float("inf") and lo == 0.0:
        return f"< {hi:.2f}"
    if hi == float("inf") and lo > 0.0:
        return f"> {lo:.2f}"
    return "?" if hi == float("inf") else f"{lo:.2f}-{hi:.2f}"


def goodput_rows(path: Path) -> tuple[str, dict[str, Any]]:
    payload = json.loads(path.read_text())
    config = payload["config"]
    order = ",".join(config.get("modes") or [])
    share = config.get("gpu_share", "?")
    series = {s["mode"]: s for s in payload.get("goodput", {}).get("series", [])}
    warm = {r["mode"]: r["warmup"] for r in payload["runs"] if "warmup" in r}
    mps = [r["deployment"].get("mps") for r in payload["runs"] if "deployment" in r]
    used = "MPS " + share if any(mps) else "no MPS"  # colocated never takes it
    label = f"{order} [{used}]"
    return label, {"series": series, "warm": warm, "commit": config.get("git_commit"),
                   "command": config.get("command")}  # fmt: skip


def print_goodput(paths: list[Path]) -> None:
    header = ["run (order [MPS, share])", *MODES, "disagg/coloc", "cond/best", "warm-up s"]
    rows = []
    for path in paths:
        label, data = goodput_rows(path)
        rps = {m: (data["series"].get(m) or {}).get("goodput_rps") for m in MODES}
        bound = {m: (data["series"].get(m) or {}).get("bound") for m in MODES}
        col, dis, con = (_interval(rps[m], bound[m]) for m in MODES)
        ratio = _ratio(dis, col)  # a run with one rate gives bounds, not values
        known = [v for v in (col, dis) if v is not None]
        best = (max(v[0] for v in known), max(v[1] for v in known)) if known else None
        cond = _ratio(con, best)
        cells = [f"{_fmt(rps[m])}{'' if bound[m] in (None, 'interpolated') else ' (' + bound[m] + ')'}"
                 for m in MODES]  # fmt: skip
        warm = " ".join(f"{m[:3]}:{w['duration_s']:.0f}" for m, w in data["warm"].items())
        rows.append([label, *cells, ratio, cond, warm])
        print(f"{path.name}: commit {data['commit']}\n  {data['command']}")
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    print("\ngoodput (req/s, >= 90% of requests within every SLO; issue #48's must-hold: "
          "disagg/coloc >= 1.3, cond/best >= 1.0)")  # fmt: skip
    for row in [header, ["-" * w for w in widths], *rows]:
        print("  ".join(str(c).ljust(w) for c, w in zip(row, widths, strict=True)))


def print_attainment(paths: list[Path]) -> None:
    """Each mode's share of requests within every SLO at each rate, per run: the modes'
    orders compared rate for rate (a run with one rate has no goodput of its own)."""
    rows, rates = [], set()
    for path in paths:
        payload = json.loads(path.read_text())
        for series in payload.get("goodput", {}).get("series", []):
            att = dict(zip(series["request_rates"], series["attainment"]["all"], strict=True))
            rates |= set(att)
            rows.append((path.stem, series["mode"], att))
    cols = sorted(rates, key=float)
    header = ["run", "mode", *(f"r={r}" for r in cols)]
    body = [[stem, mode, *(_fmt(att.get(r), "{:.0%}") for r in cols)] for stem, mode, att in rows]
    widths = [max(len(r[i]) for r in [header, *body]) for i in range(len(header))]
    print("\nSLO attainment (share of requests within every SLO) by rate")
    for row in [header, ["-" * w for w in widths], *body]:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)))


def print_tier(paths: list[Path]) -> None:
    keys = [("prefix_hit_rate", "prefix hit rate", "{:.1%}"),
            ("mean_ttft_ms", "TTFT mean (ms)", "{:.1f}"), ("p99_ttft_ms", "TTFT p99 (ms)", "{:.1f}"),
            ("mean_ttft_pull_ms", "TTFT pull part mean (ms)", "{:.1f}"),
            ("mean_ttft_blocks_ms", "TTFT blocks part mean (ms)", "{:.1f}"),
            ("mean_tpot_ms", "TPOT mean (ms)", "{:.1f}"),
            ("tier_pull_gbps", "host-tier pull (GB/s)", "{:.2f}")]  # fmt: skip
    runs = []
    for path in paths:
        payload = json.loads(path.read_text())
        for run in payload["runs"]:
            runs.append((f"{run['mode']} ({path.stem})", run["metrics"]))
    header = ["metric", *(name for name, _ in runs)]
    body = [[title, *(_fmt(m.get(key), fmt) for _, m in runs)] for key, title, fmt in keys]
    widths = [max(len(r[i]) for r in [header, *body]) for i in range(len(header))]
    print("\nhost tier, multi-turn (issue #48's must-hold: disaggregated TTFT mean and p99 "
          "lower with the tier than without)")  # fmt: skip
    for row in [header, ["-" * w for w in widths], *body]:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--goodput", nargs="*", type=Path, default=[])
    p.add_argument("--tier", nargs="*", type=Path, default=[])
    args = p.parse_args(argv)
    goodput = [path for path in args.goodput if path.exists()]
    tier = [path for path in args.tier if path.exists()]
    if goodput:
        print_goodput(goodput)
        print_attainment(goodput)
    if tier:
        print_tier(tier)


if __name__ == "__main__":
    main()
