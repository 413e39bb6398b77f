"""The decode step / memory floor of ``pdserve bench engine`` JSON files against issue
#47's goals, as one markdown table and one JSON (``bash benchmarks/gpu.sh
deepseek-speed`` writes both into $OUT).

    python benchmarks/floor_table.py OUT/engine_*.json --json OUT/deepseek_speed.json

One row per (file, batch): shape, KV cache dtype, step ms, floor ms, step / floor, the
(layer, expert) pairs a step read, and the goal that applies (#47: V4-Flash <= 2.0x at
batch 1 and 2.5x at 64; V3.2 <= 2.0x; 30b-a3b full depth <= 2.0x at 1, 1.5x at 16 and 64;
MLA at 64 <= 1.5x) with whether it holds. Each file's commit, command and card come along.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any


def goal(shape: str | None, batch: int) -> float | None:
    """#47's step / floor goal for a shape at a batch size (None: no goal)."""
    if shape == "dsv4-flash":
        return 2.0 if batch == 1 else 2.5 if batch == 64 else None
    if shape == "dsv32":
        return 2.0
    if shape == "30b-a3b-full":
        return 2.0 if batch == 1 else 1.5
    if shape == "dsv3" and batch == 64:
        return 1.5
    return None


def rows_of(path: Path) -> list[dict[str, Any]]:
    payload = json.loads(path.read_text())
    config = payload["config"]
    out = []
    for row in payload["rows"]:
        ratio = row.get("engine_step_over_floor")
        want = goal(config.get("shape"), row["batch"])
        out.append(
            {
                "file": path.name,
                "shape": config.get("shape"),
                "kv_cache_dtype": config.get("kv_cache_dtype"),
                "batch": row["batch"],
                "step_ms": row.get("engine_step_ms"),
                "forward_ms": row.get("model_step_ms"),
                "floor_ms": row.get("decode_floor_ms"),
                "step_over_floor": ratio,
                "experts_read": row.get("experts_touched"),
                "goal": want,
                "holds": None if want is None or ratio is None else ratio <= want,
                "decode_tok_s": row.get("engine_decode_tok_s"),
                "commit": config.get("git_commit") or config.get("commit"),
                "device_name": config.get("device_name"),
                "command": config.get("command"),
            }
        )
    return out


def _cell(value: Any, fmt: str) -> str:
    return "-" if value is None else fmt.format(value)


def table(rows: list[dict[str, Any]]) -> str:
    head = "| shape | KV | batch | step ms | floor ms | step/floor | experts read | goal | holds |"
    lines = [head, "|" + " --- |" * 9]
    for r in rows:
        lines.append(
            f"| {r['shape']} | {r['kv_cache_dtype']} | {r['batch']} | "
            f"{_cell(r['step_ms'], '{:.2f}')} | {_cell(r['floor_ms'], '{:.2f}')} | "
            f"{_cell(r['step_over_floor'], '{:.2f}x')} | {_cell(r['experts_read'], '{:.0f}')} | "
            f"{_cell(r['goal'], '<= {:.1f}x')} | "
            f"{'-' if r['holds'] is None else 'yes' if r['holds'] else 'no'} |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("files", nargs="*", type=Path)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    rows = [r for f in args.files if f.is_file() for r in rows_of(f)]
    print(table(rows))
    if args.json is not None:
        args.json.write_text(json.dumps({"rows": rows}, indent=1))


if __name__ == "__main__":
    main()
