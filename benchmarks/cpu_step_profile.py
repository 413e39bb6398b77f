"""Decode step time on CPU by batch size: the whole step, the forward inside it, and the
step's process CPU time (which a shared machine's other load inflates less than wall time).

    python benchmarks/cpu_step_profile.py --batches 1,8,16,64 --prompt-len 256 --threads 1
    python benchmarks/cpu_step_profile.py --batches 16 --profile   # + torch.profiler by op

The embedded model (or --model DIR), fp32, prefix caching off, greedy, ignore_eos; the
median of --steps decode steps once every sequence of the batch has its first token.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from typing import Any

import torch

from pdserve.common.engine.config import EngineConfig
from pdserve.common.engine.llm_engine import LLMEngine
from pdserve.common.engine.sampling import SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default=None)
    ap.add_argument("--batches", default="1,8,16")
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--profile", action="store_true", help="torch.profiler table per batch")
    ap.add_argument("--no-prepack", action="store_true", help="cpu_weight_prepack off (F.linear)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    engine = LLMEngine(EngineConfig(model=args.model, max_num_batched_tokens=8192,
                                    cpu_weight_prepack=not args.no_prepack,
                                    enable_prefix_caching=False))  # fmt: skip
    rng = random.Random(0)
    for batch in map(int, args.batches.split(",")):
        for i in range(batch):
            prompt = [rng.randrange(100, 40000) for _ in range(args.prompt_len)]
            params = SamplingParams(max_tokens=args.steps + 2, ignore_eos=True, temperature=0.0)
            engine.add_request(f"b{batch}-{i}", prompt, params)
        while any(not req.output_token_ids for req, _ in engine._requests.values()):
            engine.step()
        forward: list[float] = []
        execute = engine.runner.execute

        def timed(plan: Any, execute: Any = execute, forward: list[float] = forward) -> Any:
            start = time.perf_counter()
            out = execute(plan)
            forward.append(time.perf_counter() - start)
            return out

        engine.runner.execute = timed  # type: ignore[method-assign]
        wall: list[float] = []
        cpu: list[float] = []
        prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
        if args.profile:
            prof.__enter__()
        for _ in range(args.steps):
            start, cpu_start = time.perf_counter(), time.process_time()
            engine.step()
            wall.append(time.perf_counter() - start)
            cpu.append(time.process_time() - cpu_start)
        if args.profile:
            prof.__exit__(None, None, None)
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))
        engine.runner.execute = execute  # type: ignore[method-assign]
        while engine.has_unfinished:
            engine.step()
        step_ms, fwd_ms = statistics.median(wall) * 1e3, statistics.median(forward) * 1e3
        print(f"batch {batch:3d}  step {step_ms:8.2f} ms  forward {fwd_ms:8.2f} ms  "
              f"host {step_ms - fwd_ms:6.2f} ms  cpu {statistics.median(cpu) * 1e3:8.2f} ms",
              flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
