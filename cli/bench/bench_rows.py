"""``pdserve bench engine``'s results: a `Row` per batch size (rates, engine/HF ratios,
the machine's floors), the tables, and the JSON with the run's configuration."""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pdserve.cli.bench.bench_runners import Timing

if TYPE_CHECKING:
    from pdserve.common.engine.llm_engine import LLMEngine


@dataclass
class Row:
    batch: int
    engine_prefill_tok_s: float
    engine_decode_tok_s: float
    engine_prefill_s: float
    engine_decode_s: float
    engine_prefill_steps: int
    hf_prefill_tok_s: float | None = None
    hf_decode_tok_s: float | None = None
    hf_prefill_s: float | None = None
    hf_decode_s: float | None = None
    prefill_ratio: float | None = None  # engine / HF: above 1, the engine is faster
    decode_ratio: float | None = None
    # Against the machine's ceilings (cli/bench/bench_floors.py): ms per decode step, of it
    # the model's forward, the memory floor of that step, and step / floor.
    engine_step_ms: float | None = None
    model_step_ms: float | None = None
    decode_floor_ms: float | None = None
    experts_touched: float | None = None  # MoE: (layer, expert) pairs a decode step reads
    engine_step_over_floor: float | None = None
    model_step_over_floor: float | None = None
    prefill_floor_s: float | None = None  # matmul FLOPs / measured matmul rate
    prefill_over_floor: float | None = None  # engine prefill seconds / that
    hf_skipped: str | None = None  # why HF has no figures at this batch size


def median_timing(runs: list[Timing]) -> Timing:
    return Timing(
        statistics.median(t.prefill_s for t in runs),
        statistics.median(t.decode_s for t in runs),
        runs[0].decode_tokens,
        runs[0].decode_steps,
        statistics.median(t.model_s for t in runs),
        None
        if runs[0].experts_touched is None
        else statistics.mean(t.experts_touched or 0.0 for t in runs),
    )


def add_floors(row: Row, engine: Timing, ceilings: Any, prompt_len: int, gen_len: int) -> None:
    from pdserve.cli.bench.bench_floors import decode_floor_s, prefill_floor_s

    if engine.decode_steps:
        # timed steps decode tokens 2..gen_len: contexts prompt_len + 1 .. prompt_len + gen_len - 1
        floor = decode_floor_s(
            ceilings, row.batch, prompt_len + gen_len / 2, engine.experts_touched
        )
        row.experts_touched = engine.experts_touched
        row.engine_step_ms = engine.decode_s / engine.decode_steps * 1e3
        row.model_step_ms = engine.model_s / engine.decode_steps * 1e3
        row.decode_floor_ms = floor * 1e3
        row.engine_step_over_floor = row.engine_step_ms / row.decode_floor_ms
        row.model_step_over_floor = row.model_step_ms / row.decode_floor_ms
    row.prefill_floor_s = prefill_floor_s(ceilings, row.batch, prompt_len)
    row.prefill_over_floor = engine.prefill_s / row.prefill_floor_s


def make_row(batch: int, prompt_len: int, engine: Timing, steps: int, hf: Timing | None) -> Row:
    row = Row(
        batch=batch,
        engine_prefill_tok_s=batch * prompt_len / engine.prefill_s,
        engine_decode_tok_s=engine.decode_tokens / engine.decode_s,
        engine_prefill_s=engine.prefill_s,
        engine_decode_s=engine.decode_s,
        engine_prefill_steps=steps,
    )
    if hf is not None:
        row.hf_prefill_s, row.hf_decode_s = hf.prefill_s, hf.decode_s
        row.hf_prefill_tok_s = batch * prompt_len / hf.prefill_s
        # Noise can beat a decode this short; a non-positive time has no rate.
        row.hf_decode_tok_s = hf.decode_tokens / hf.decode_s if hf.decode_s > 0 else None
        row.prefill_ratio = row.engine_prefill_tok_s / row.hf_prefill_tok_s
        if row.hf_decode_tok_s:
            row.decode_ratio = row.engine_decode_tok_s / row.hf_decode_tok_s
    return row


COLUMNS = (
    ("batch", "batch", "{:d}"),
    ("engine_prefill_tok_s", "engine prefill tok/s", "{:.1f}"),
    ("hf_prefill_tok_s", "HF prefill tok/s", "{:.1f}"),
    ("prefill_ratio", "prefill engine/HF", "{:.2f}x"),
    ("engine_decode_tok_s", "engine decode tok/s", "{:.1f}"),
    ("hf_decode_tok_s", "HF decode tok/s", "{:.1f}"),
    ("decode_ratio", "decode engine/HF", "{:.2f}x"),
)


FLOOR_COLUMNS = (
    ("batch", "batch", "{:d}"),
    ("engine_step_ms", "decode step ms", "{:.2f}"),
    ("model_step_ms", "of it forward ms", "{:.2f}"),
    ("decode_floor_ms", "memory floor ms", "{:.2f}"),
    ("experts_touched", "experts read", "{:.0f}"),
    ("engine_step_over_floor", "step/floor", "{:.2f}x"),
    ("model_step_over_floor", "forward/floor", "{:.2f}x"),
    ("engine_prefill_s", "prefill s", "{:.4f}"),
    ("prefill_floor_s", "matmul floor s", "{:.4f}"),
    ("prefill_over_floor", "prefill/floor", "{:.2f}x"),
)


def format_table(rows: list[Row], columns: tuple[tuple[str, str, str], ...] = COLUMNS) -> str:
    """A cell without a value is "-", or "skipped" in HF's columns where HF could not run."""
    header = [title for _, title, _ in columns]

    def cell(row: Row, key: str, fmt: str) -> str:
        value = getattr(row, key)
        if value is not None:
            return fmt.format(value)
        is_hf = key.startswith("hf_") or key in ("prefill_ratio", "decode_ratio")
        return "skipped" if row.hf_skipped and is_hf else "-"

    body = [[cell(row, key, fmt) for key, _, fmt in columns] for row in rows]
    widths = [max(len(line[i]) for line in [header, *body]) for i in range(len(header))]

    def line(cells: list[str]) -> str:
        return "  ".join(cell.rjust(w) for cell, w in zip(cells, widths, strict=True))

    return "\n".join([line(header), line(["-" * w for w in widths]), *map(line, body)])


def bench_config(
    args: argparse.Namespace, engine: LLMEngine, load_at_start: float
) -> dict[str, Any]:
    import torch

    from pdserve.cli.provenance import provenance

    config: dict[str, Any] = {
        **provenance(),
        "model": args.model or "embedded default",
        "shape": args.shape,
        "model_dir": str(engine.model_dir),
        "device": args.device,
        "device_name": device_name(args.device),
        "dtype": engine.config.torch_dtype_name,
        "kv_cache_dtype": engine.config.kv_cache_dtype,
        "torch_version": torch.__version__,
        "transformers_version": None,
        "prompt_len": args.prompt_len,
        "gen_len": args.gen_len,
        "batch_sizes": args.batch_sizes,
        "repeats": args.repeats,
        "seed": args.seed,
        "cpu_count": os.cpu_count(),
        "torch_num_threads": torch.get_num_threads(),
        "hf": not args.no_hf,
        # Other processes on the machine skew every number here: keep the evidence.
        "loadavg_1m_start": load_at_start,
        "loadavg_1m_end": os.getloadavg()[0],
    }
    if not args.no_hf:
        import transformers

        config["transformers_version"] = transformers.__version__
    if args.device == "cpu":  # the CPU's flags, the compiled kernels' ISA and their choices
        from pdserve.kernels import cpu_native

        config["cpu"] = cpu_native.describe()
    return config


def device_name(device: str) -> str:
    import torch

    if device == "cuda":
        return torch.cuda.get_device_name()
    return _cpu_model() or platform.processor() or platform.machine()


def _cpu_model() -> str | None:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:  # not Linux
        pass
    return None


def write_json(path: Path, config: dict[str, Any], rows: list[Row]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {"benchmark": "engine", "config": config, "rows": [asdict(r) for r in rows]}
    path.write_text(json.dumps(payload, indent=2) + "\n")
