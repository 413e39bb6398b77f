"""The host's work of an engine decode step, with compute made negligible (#49).

A one-layer, hidden-64 random Llama (the embedded tokenizer, a 2,048-token LM head) on CPU,
so the forward costs ~nothing and a step's wall time is the engine's Python: scheduling, inputs,
sampling, stop rules, detokenising, outputs. At each batch size, ``--steps`` decode steps
once every sequence has its first token; the model's forward is timed apart (host: the
rest of the step).

    python benchmarks/host_step.py --batches 1,64,256 --json results/host_step_X.json
    python benchmarks/host_step.py --batches 256 --profile      # + cProfile's top functions

``--mode async`` runs the engine as on CUDA (async_scheduling: greedy tokens read a step
late); ``sync`` as on CPU (the host sampler); ``both`` (default) each. ``--temperatures``:
greedy (0) and OpenAI's default temperature (1, what benchmarks/fairness.py's requests
get), whose rows the host sampler draws (never asynchronous).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import itertools
import json
import pstats
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from pdserve.common.engine.config import EngineConfig
from pdserve.common.engine.llm_engine import LLMEngine
from pdserve.common.engine.sampling import SamplingParams
from pdserve.common.model.fixtures.random import save_random_llama


def measure(
    model: Path,
    batch: int,
    steps: int,
    is_async: bool,
    temperature: float,
    profile: bool,
    sort: str = "tottime",
) -> dict[str, Any]:
    engine = LLMEngine(EngineConfig(
        model=str(model), num_kv_blocks=8 * batch + 64, max_num_seqs=batch,
        max_num_batched_tokens=max(2048, batch * 48), async_scheduling=is_async,
    ))  # fmt: skip
    params = SamplingParams(max_tokens=steps + 16, ignore_eos=True, temperature=temperature)
    for i in range(batch):
        engine.add_request(f"r{i}", [5 + i % 100 + j for j in range(40)], params)
    while any(not req.output_token_ids for req, _ in engine._requests.values()):
        engine.step()
    for _ in range(3):
        engine.step()
    forward: list[float] = []
    began: list[float] = []
    model = engine.runner.model  # type: ignore[attr-defined]
    model.register_forward_pre_hook(lambda *_: began.append(time.perf_counter()))
    model.register_forward_hook(lambda *_: forward.append(time.perf_counter() - began[-1]))
    walls: list[float] = []
    prof = cProfile.Profile() if profile else None
    for _ in range(steps):
        start = time.perf_counter()
        if prof is not None:
            prof.enable()
        outputs = engine.step()
        if prof is not None:
            prof.disable()
        walls.append(time.perf_counter() - start)
        assert len(outputs) == batch, (len(outputs), batch)
    result = {
        "batch": batch,
        "mode": "async" if is_async else "sync",
        "temperature": temperature,
        "steps": steps,
        "step_ms_median": round(1e3 * statistics.median(walls), 3),
        "step_ms_mean": round(1e3 * statistics.fmean(walls), 3),
        "forward_ms_median": round(1e3 * statistics.median(forward), 3),
        "host_ms_median": round(1e3 * (statistics.median(walls) - statistics.median(forward)), 3),
    }
    if prof is not None:
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats(sort).print_stats(30)
        result["profile"] = out.getvalue()
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--batches", default="1,64,256")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--mode", choices=("async", "sync", "both"), default="both")
    ap.add_argument(
        "--temperatures",
        default="0,1",
        help="requests' temperatures, one run each (0: greedy; 1: OpenAI's default)",
    )
    ap.add_argument("--profile", action="store_true", help="cProfile of the timed steps")
    ap.add_argument("--sort", default="tottime", help="cProfile's order (tottime, cumulative)")
    ap.add_argument("--vocab", type=int, default=2048, help="the model's (LM head) vocabulary")
    ap.add_argument("--label", default="", help="what the run measured (recorded in the JSON)")
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args()
    torch.set_num_threads(1)
    modes = {"async": [True], "sync": [False], "both": [True, False]}[args.mode]
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        model = save_random_llama(Path(tmp) / "m", num_layers=1, hidden_size=64, num_heads=2,
                                  num_kv_heads=1, intermediate_size=64,
                                  vocab_size=args.vocab)  # fmt: skip
        for temperature, is_async, batch in itertools.product(
            map(float, args.temperatures.split(",")), modes, map(int, args.batches.split(","))
        ):
            r = measure(model, batch, args.steps, is_async, temperature, args.profile, args.sort)
            print(
                f"T={temperature:g} {r['mode']:5} batch {batch:4}: step {r['step_ms_median']:7.2f} "
                f"ms (mean {r['step_ms_mean']:.2f}), forward {r['forward_ms_median']:.2f} ms, "
                f"host {r['host_ms_median']:.2f} ms"
            )
            if args.profile:
                print(r.pop("profile")[:5000])
            results.append(r)
    if args.json:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, check=False).stdout.strip()  # fmt: skip
        dirty = bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                                    capture_output=True, text=True, check=False).stdout.strip())  # fmt: skip
        Path(args.json).write_text(json.dumps({
            "commit": commit + ("-dirty" if dirty else ""),
            "label": args.label,
            "torch_threads": 1,
            "vocab": args.vocab,
            "load_average": list(__import__("os").getloadavg()),
            "results": results,
        }, indent=1) + "\n")  # fmt: skip


if __name__ == "__main__":
    main()
