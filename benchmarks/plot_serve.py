"""Plot a ``pdserve bench serve --compare --max-concurrency a,b,c [--hf-reference]`` JSON.

    python benchmarks/plot_serve.py benchmarks/results/serve_h200.json benchmarks/results/serve_h200.png

Four panels against concurrency, one line per mode (disaggregated, colocated, HF
generate, a --peer-url server under its --peer-label): output token throughput, TTFT p50/p99, TPOT p50/p99, ITL p50/p99.

A JSON with a goodput sweep (``--request-rate a,b,c --goodput ...``) is plotted as SLO
attainment against request rate instead: one panel per target (TTFT only, TPOT only,
E2E only) and one for all of them, one line per mode, the 90% line and each mode's goodput.
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any


def main(src: str, dst: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    payload = json.loads(Path(src).read_text())
    if "goodput" in payload:
        plot_goodput(plt, payload, dst)
        return
    series: dict[str, list[dict]] = defaultdict(list)
    for run in payload["runs"]:
        series[run.get("mode", run["label"])].append(run)
    cfg = payload["config"]
    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    panels = [
        ("output_throughput", "output tokens/s", [""]),
        ("ttft", "TTFT (ms)", ["median", "p99"]),
        ("tpot", "TPOT (ms)", ["median", "p99"]),
        ("itl", "ITL (ms)", ["median", "p99"]),
    ]
    colors = {mode: f"C{i}" for i, mode in enumerate(series)}
    for ax, (key, title, stats) in zip(axes.flat, panels, strict=True):
        for mode, runs in series.items():
            runs = sorted(runs, key=lambda r: r.get("load") or cfg["num_prompts"])
            xs = [r.get("load") or cfg["num_prompts"] for r in runs]
            for stat in stats:
                name = key if not stat else f"{stat}_{key}_ms"
                ys = [r["metrics"].get(name) for r in runs]
                if all(y is None for y in ys):
                    continue
                style = "-o" if stat in ("", "median") else "--x"
                ax.plot(xs, ys, style, color=colors[mode], label=f"{mode} {stat}".strip())
        ax.set_xscale("log", base=2)
        ax.set_xlabel("max concurrency")
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(
        f"pdserve bench serve: {Path(str(payload['runs'][0]['server']['model'])).name}, "
        f"{cfg['num_prompts']} prompts, input {cfg['input_len']}, output {cfg['output_len']}"
    )
    fig.tight_layout()
    fig.savefig(dst, dpi=110)
    print(f"wrote {dst}")


def plot_goodput(plt: Any, payload: dict[str, Any], dst: str) -> None:
    cfg, sweep = payload["config"], payload["goodput"]
    slos = sweep["slos_ms"]
    names = [*slos, "all"]
    titles = {"ttft": "TTFT", "tpot": "TPOT", "e2el": "E2E latency"}
    fig, axes = plt.subplots(1, len(names), figsize=(4.2 * len(names), 4.2), squeeze=False)
    for i, s in enumerate(sweep["series"]):
        # an infinite rate (all at once) has no place on a rate axis
        points = [(float(r), k) for k, r in enumerate(s["request_rates"]) if r != "inf"]
        name = (
            s["mode"] if s["max_concurrency"] is None else f"{s['mode']} c={s['max_concurrency']}"
        )
        sign = {"interpolated": "", "above_highest": ">= ", "below_lowest": "< "}.get(s["bound"])
        if sign is not None:
            name += f" (goodput {sign}{s['goodput_rps']:.2f} req/s)"
        for ax, slo in zip(axes[0], names, strict=True):
            ys = [100 * s["attainment"][slo][k] for _, k in points]
            ax.plot([r for r, _ in points], ys, "-o", color=f"C{i}", label=name)
            if slo == "all" and s["bound"] == "interpolated":
                ax.axvline(s["goodput_rps"], color=f"C{i}", ls=":", lw=1)
    for ax, slo in zip(axes[0], names, strict=True):
        if slo == "all":
            title = " and ".join(titles[n] for n in slos) + " (good)"
        else:
            title = f"{titles[slo]} only: <= {slos[slo]:g} ms"
        ax.set_title(title, fontsize=10)
        ax.axhline(100 * sweep["target"], color="grey", ls="--", lw=1)
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylim(-3, 103)
        ax.grid(True, alpha=0.3)
    axes[0][0].set_ylabel("SLO attainment (% of requests)")
    axes[0][-1].legend(fontsize=8)
    lengths = f"input {cfg['input_len']}, output {cfg['output_len']}"
    if cfg.get("length_dist", "fixed") != "fixed":
        lengths += f" (lognormal medians, caps {cfg['max_input_len']} / {cfg['max_output_len']})"
    fig.suptitle(
        f"SLO attainment: {Path(str(payload['runs'][0]['server']['model'])).name}, "
        f"{cfg['num_prompts']} prompts a rate, {lengths}; dotted: goodput (90% good)",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(dst, dpi=110)
    print(f"wrote {dst}")


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    main(sys.argv[1], sys.argv[2])
