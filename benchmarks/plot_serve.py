"""Plot a ``pdserve bench serve --compare --max-concurrency a,b,c [--hf-reference]`` JSON.

    python benchmarks/plot_serve.py benchmarks/results/serve_h200.json benchmarks/results/serve_h200.png

Four panels against concurrency, one line per mode (disaggregated, colocated, HF
generate, a --peer-url server under its --peer-label): output token throughput, TTFT p50/p99, TPOT p50/p99, ITL p50/p99.
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path


def main(src: str, dst: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    payload = json.loads(Path(src).read_text())
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


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    main(sys.argv[1], sys.argv[2])
