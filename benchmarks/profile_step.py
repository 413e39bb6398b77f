"""Where a decode step's time goes: cProfile of the engine's host work over decode steps,
next to the GPU time of the forward (CUDA events), at one batch size.

    python benchmarks/profile_step.py --shape 1b --batch 64 --context 1024 [--tokenizer DIR]

Prints the step and forward times and the functions with the most host time (tottime).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time

import torch

from pdserve.common.engine.config import EngineConfig
from pdserve.common.engine.llm_engine import LLMEngine
from pdserve.common.engine.sampling import SamplingParams
from pdserve.common.model.random import random_shape_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--shape", default="1b")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--tokenizer", default=None)
    args = ap.parse_args()
    path = random_shape_model(args.shape, device="cuda", tokenizer_from=args.tokenizer)
    blocks = -(-(args.context + args.steps + 16) // 64)
    engine = LLMEngine(
        EngineConfig(
            model=str(path),
            device="cuda",
            dtype="bfloat16",
            num_kv_blocks=args.batch * blocks,
            max_num_seqs=args.batch,
            max_num_batched_tokens=args.batch * args.context,
            enable_prefix_caching=False,
        )
    )
    for i in range(args.batch):
        prompt = [(i * 7919 + j * 31) % 40000 + 5 for j in range(args.context)]
        engine.add_request(
            f"r{i}", prompt, SamplingParams(max_tokens=args.steps + 16, ignore_eos=True)
        )
    for _ in range(6):  # prefill, then warm decode steps
        engine.step()
    runner = engine.runner
    execute = runner.execute
    gpu_ms: list[float] = []

    def timed(plan):  # noqa: ANN001, ANN202
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = execute(plan)
        end.record()
        gpu_ms.append((start, end))
        return out

    runner.execute = timed
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    for _ in range(args.steps):
        engine.step()
    prof.disable()
    torch.cuda.synchronize()
    step_ms = (time.perf_counter() - t0) / args.steps * 1e3
    fwd = sorted(s.elapsed_time(e) for s, e in gpu_ms)
    print(
        f"{args.shape} batch {args.batch} context {args.context}: step {step_ms:.3f} ms (profiled), "
        f"GPU forward median {fwd[len(fwd) // 2]:.3f} ms"
    )
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(18)
    print(out.getvalue())


if __name__ == "__main__":
    main()
