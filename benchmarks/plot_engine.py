"""Plot ``pdserve bench engine`` JSONs: decode step and forward time over the memory floor,
prefill over the matmul floor, one group of bars per (file, batch size).

    python benchmarks/plot_engine.py OUT.png A.json [B.json ...]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main(dst: str, *sources: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels, step, forward, prefill = [], [], [], []
    commits = set()
    for src in sources:
        payload = json.loads(Path(src).read_text())
        cfg = payload["config"]
        commits.add(str(cfg.get("git_commit", "?"))[:10])
        name = cfg.get("shape") or Path(cfg["model_dir"]).name
        if "async_scheduling" in cfg:  # bench engine JSONs from session 28 on
            name += " async" if cfg["async_scheduling"] else " sync"
        for row in payload["rows"]:
            labels.append(f"{name} {cfg['prompt_len'] // 1024}k\nbatch {row['batch']}")
            step.append(row["engine_step_over_floor"])
            forward.append(row["model_step_over_floor"])
            prefill.append(row["prefill_over_floor"])
    fig, ax = plt.subplots(figsize=(max(8, 1.1 * len(labels)), 5))
    xs = range(len(labels))
    width = 0.27
    ax.bar([x - width for x in xs], step, width, label="decode step / memory floor")
    ax.bar(list(xs), forward, width, label="decode forward / memory floor")
    ax.bar([x + width for x in xs], prefill, width, label="prefill / matmul floor")
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(list(xs), labels, fontsize=8)
    ax.set_ylabel("time over its floor (1.0 = the hardware's limit)")
    ax.set_title(
        f"pdserve bench engine on {cfg.get('device_name', '?')} (commit {', '.join(sorted(commits))})"
    )
    for x, value in zip(xs, step, strict=True):
        ax.text(x - width, value + 0.03, f"{value:.2f}", ha="center", fontsize=7)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(dst, dpi=110)


if __name__ == "__main__":
    main(*sys.argv[1:])
