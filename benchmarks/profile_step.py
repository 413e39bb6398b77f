"""Where a decode step's time goes: cProfile of the engine's host work over decode steps,
next to the GPU time of the forward (CUDA events), at one batch size.

    python benchmarks/profile_step.py --shape 1b --batch 64 --context 1024 [--tokenizer DIR]
        [--kernels]   (also the GPU time by kernel of one decode step and of the prefill)

Prints the step and forward times and the functions with the most host time (tottime).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time

import torch

from pdserve.cli.bench.bench_engine import group_blocks
from pdserve.common.engine.config import EngineConfig
from pdserve.common.engine.llm_engine import LLMEngine
from pdserve.common.engine.sampling import SamplingParams
from pdserve.common.model.fixtures.random_shapes import random_shape_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--shape", default="1b")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--tokenizer", default=None)
    ap.add_argument(
        "--kernels",
        action="store_true",
        help="also: the GPU time of one eager decode forward by kernel (torch.profiler)",
    )
    args = ap.parse_args()
    path = random_shape_model(args.shape, device="cuda", tokenizer_from=args.tokenizer)
    tokens = args.context + args.steps + 16
    # every cache group's blocks (V4's window, compressed and indexer groups: 142 at 2k, not 33)
    blocks = max(-(-tokens // 64), group_blocks(str(path), tokens, args.context, 64))
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
    runner = engine.runner
    execute = runner.execute
    prefills: list[tuple] = []  # the prefill step's plan (kernel table below)
    runner.execute = lambda plan, *rest: prefills.append((plan, *rest)) or execute(plan, *rest)
    engine.step()
    del runner.execute
    for _ in range(5):  # warm decode steps
        engine.step()
    gpu_ms: list[float] = []

    def timed(plan, *rest):  # noqa: ANN001, ANN002, ANN202
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = execute(plan, *rest)
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
    if args.kernels:
        captured = []
        runner.execute = lambda plan, *rest: (
            captured.append((plan, *rest)) or execute(*captured[-1])
        )
        engine.step()
        kernel_table("decode", runner, execute, captured[-1])
        kernel_table(f"prefill of {args.batch} x {args.context}", runner, execute, prefills[0])


def kernel_table(what: str, runner, execute, call: tuple) -> None:  # noqa: ANN001
    """One step's forward (``call``: its plan and carry) run eagerly (graphs off) under
    torch.profiler: GPU time by kernel, grouped into GEMMs, attention, pointwise and the
    rest."""
    from torch.profiler import ProfilerActivity, profile

    graphs, runner.graphs = runner.graphs, None
    for _ in range(3):
        execute(*call)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            execute(*call)
        torch.cuda.synchronize()
    runner.graphs = graphs
    groups: dict[str, float] = {}
    rows = []
    for event in prof.key_averages():
        us = event.device_time_total / 5
        if us <= 0:
            continue
        name = event.key
        kind = (
            "gemm" if any(k in name.lower() for k in ("gemm", "gemv", "cutlass", "sm90", "matmul"))
            else "attention" if "_decode_" in name or "_prefill_" in name or "write_kv" in name
            else "pointwise" if any(k in name for k in ("rms_norm", "rotary", "silu"))
            else "other"
        )  # fmt: skip
        groups[kind] = groups.get(kind, 0.0) + us
        rows.append((us, event.count // 5, name[:90]))
    total = sum(groups.values())
    launches = sum(n for _, n, _ in rows)
    print(
        f"{what}: eager forward, GPU time by kind: {total / 1e3:.3f} ms in all, "
        f"{launches} kernel launches"
    )
    for kind, us in sorted(groups.items(), key=lambda kv: -kv[1]):
        print(f"  {kind:10s} {us / 1e3:8.3f} ms  {us / total:6.1%}")
    print("  by time (ms, launches, kernel):")
    for us, n, name in sorted(rows, reverse=True)[:16]:
        print(f"  {us / 1e3:8.3f} ms {n:6d}  {name}")
    print("  by launches:")
    for us, n, name in sorted(rows, key=lambda r: -r[1])[:24]:
        print(f"  {us / 1e3:8.3f} ms {n:6d}  {name}")


if __name__ == "__main__":
    main()
