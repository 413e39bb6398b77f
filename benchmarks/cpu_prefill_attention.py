"""CPU prefill attention of one layer: the torch reference (gather, repeat the KV heads,
causal SDPA per sequence) against the compiled kernel (kernels/cpu_native.py), at the
embedded model's shape.

    python benchmarks/cpu_prefill_attention.py [--cases 1x512,4x512,1x2048,chunk] [--json F]
        [--isa auto|avx512|avx2|portable]

``--isa`` picks the compiled kernel's build (default: the best this CPU runs, as pdserve
does). An AVX2-only machine reproduced on an AVX-512 one: ``--isa avx2`` with torch held to
AVX2 too (its reference then runs its AVX2 kernels, as it would there)::

    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2_VNNI_2 MKL_ENABLE_INSTRUCTIONS=AVX2 \
        python benchmarks/cpu_prefill_attention.py --isa avx2

The JSON records the CPU's flags, the build that ran, torch's CPU capability and the load
average (a shared machine's timings are noisy: the ratio of the two, measured back to
back, is the figure).

A case ``NxL`` is N whole prompts of L tokens; ``chunk`` is a 512-token chunk after 1,536
cached tokens (chunked prefill, or a prefix-cache hit). Each call takes the next of 30
layer views of one cache, as a step walks its layers; the median of --repeats calls, the reference and the kernel timed alternately (the speedup: the median of the per-pair ratios).
GFLOP/s counts the causal half of QK^T and PV (4 * q_len * keys seen * D * H_q); beside
each case, the machine's GEMM rate at that moment (torch.mm 1024^3) and its ratio to the
reference's rate: no kernel doing the same FLOPs gains more than that.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable

import torch

from pdserve.cli.provenance import provenance
from pdserve.common.engine.host_malloc import keep_freed_buffers
from pdserve.kernels import cpu_native, reference


def paired_ms(
    ref: Callable[[int], object],
    native: Callable[[int], object],
    repeats: int,
    clock: Callable[[], float] = time.perf_counter,
) -> tuple[float, float, float]:
    """Median ms of each path and the median of the per-pair ratios, the two timed
    alternately (ref, native, ref, ...) so that a shared machine's busy moments fall on both."""
    for i in range(3):
        ref(i)
        native(i)
    ref_t, native_t = [], []
    for i in range(repeats):
        for fn, times in ((ref, ref_t), (native, native_t)):
            start = clock()
            fn(i)
            times.append(clock() - start)
    ratio = statistics.median(r / n for r, n in zip(ref_t, native_t, strict=True))
    return statistics.median(ref_t) * 1e3, statistics.median(native_t) * 1e3, ratio


def matmul_gflop_s(repeats: int, clock: Callable[[], float]) -> float:
    """The machine's GEMM rate now (torch.mm, 1024^3, float32, the same threads and clock):
    the floor attention's FLOPs could run at, measured beside each case. matmul / reference
    is the most any kernel doing the same FLOPs could gain over the reference here."""
    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    for _ in range(2):
        a @ b
    times = []
    for _ in range(max(3, repeats // 2)):
        start = clock()
        a @ b
        times.append(clock() - start)
    return 2 * 1024**3 / statistics.median(times) / 1e9


def seqs_of(case: str) -> list[tuple[int, int]]:
    """(context, new tokens) per sequence."""
    if case == "chunk":
        return [(2048, 512)]
    n, length = map(int, case.split("x"))
    return [(length, length)] * n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--cases", default="1x512,4x512,1x2048,chunk")
    ap.add_argument("--heads", default="9,3,64", help="H_q,H_kv,D (default: SmolLM2-135M)")
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--json", default=None)
    ap.add_argument("--isa", default="auto", choices=["auto", *cpu_native.ISAS])
    ap.add_argument(
        "--cpu-time",
        action="store_true",
        help="time the process's CPU time, not the wall clock: with --threads 1, the cycles "
        "each path takes whatever else the machine runs (a shared machine's measure)",
    )
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    keep_freed_buffers()
    load_before = os.getloadavg()
    module = cpu_native.load() if args.isa == "auto" else cpu_native.load_isa(args.isa)
    assert module is not None, "the compiled kernel did not build"
    num_heads, num_kv_heads, head_dim = map(int, args.heads.split(","))
    block, layers, scale = args.block_size, 30, head_dim**-0.5
    gen = torch.Generator().manual_seed(0)
    clock = time.process_time if args.cpu_time else time.perf_counter
    rows = []
    for case in args.cases.split(","):
        seqs = seqs_of(case)
        blocks = [-(-ctx // block) for ctx, _ in seqs]
        num_blocks = sum(blocks) + 1
        cache = torch.randn(num_blocks, layers, 2, num_kv_heads, block, head_dim, generator=gen)
        views = [cache[:, i] for i in range(layers)]
        tables = torch.zeros(len(seqs), max(blocks), dtype=torch.int32)
        ids = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
        for s, n in enumerate(blocks):
            tables[s, :n] = torch.tensor(ids[:n])
            del ids[:n]
        lens = torch.tensor([ctx for ctx, _ in seqs], dtype=torch.int32)
        q_lens = torch.tensor([n for _, n in seqs])
        cu = torch.cat([torch.zeros(1, dtype=torch.long), q_lens.cumsum(0)]).int()
        q = torch.randn(int(q_lens.sum()), num_heads, head_dim, generator=gen)
        a = (cu, lens, tables, scale)
        ref, native, ratio = paired_ms(
            lambda i, q=q, v=views, a=a: reference.prefill_attention(q, v[i % layers], *a),
            lambda i, q=q, v=views, a=a: cpu_native.prefill_attention(
                q, v[i % layers], *a, None, module
            ),
            args.repeats,
            clock,
        )
        mm = matmul_gflop_s(args.repeats, clock)
        pairs = sum(n * (ctx - n) + n * (n + 1) // 2 for ctx, n in seqs)  # (query, key) seen
        flops = 4 * pairs * head_dim * num_heads
        rows.append({"case": case, "query_tokens": int(q_lens.sum()),
                     "reference_ms": round(ref, 3), "native_ms": round(native, 3),
                     "speedup": round(ratio, 2),
                     "reference_gflop_s": round(flops / ref / 1e6, 1),
                     "native_gflop_s": round(flops / native / 1e6, 1),
                     "matmul_gflop_s": round(mm, 1),
                     "max_speedup": round(mm / (flops / ref / 1e6), 2)})  # fmt: skip
    print(f"build: {module.isa()}; torch CPU capability: {torch.backends.cpu.get_cpu_capability()}; "
          f"load average {load_before} -> {os.getloadavg()}")  # fmt: skip
    print(
        "| case | query tokens | reference (ms) | compiled (ms) | speedup | GFLOP/s ref / compiled "
        "/ matmul | matmul / ref |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['case']} | {r['query_tokens']} | {r['reference_ms']} | {r['native_ms']} | "
              f"{r['speedup']}x | {r['reference_gflop_s']} / {r['native_gflop_s']} / "
              f"{r['matmul_gflop_s']} | {r['max_speedup']}x |")  # fmt: skip
    if args.json:
        config = {**provenance(), **vars(args), "cpu_count": os.cpu_count(),
                  **cpu_native.describe(), "build_isa": module.isa(),
                  "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
                  "load_average_before": load_before, "load_average_after": os.getloadavg(),
                  "env": {k: os.environ[k] for k in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA",
                          "MKL_ENABLE_INSTRUCTIONS", "OMP_NUM_THREADS") if k in os.environ}}  # fmt: skip
        with open(args.json, "w") as f:
            json.dump({"benchmark": "cpu_prefill_attention", "config": config, "rows": rows}, f,
                      indent=1)  # fmt: skip


if __name__ == "__main__":
    main()
