"""CPU decode attention of one layer: the torch reference (gather + SDPA) against the
compiled kernel (kernels/cpu_native.py), at the embedded model's shape by batch size.

    python benchmarks/cpu_decode_attention.py [--batches 1,16,64] [--context 576] [--json F]
        [--isa auto|avx512|avx2|portable]

``--isa`` picks the compiled kernel's build, as in benchmarks/cpu_prefill_attention.py
(which says how to hold torch's reference to AVX2 too). The two paths are timed
alternately; the speedup is the median of the per-pair ratios.

Each call takes the next of 30 layer views of one cache (as a step walks its layers, so no
call finds the previous one's KV in the CPU's caches); the median of --repeats calls. The
engine's malloc settings (common/engine/host_malloc.py) are applied first, as in a CPU
engine process. Also prints the bytes of K and V a call must read and the rate at which
each path reads them.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

# run as a script, benchmarks/ is on sys.path: the paired timing of the prefill benchmark
from cpu_prefill_attention import paired_ms

from pdserve.cli.provenance import provenance
from pdserve.common.engine.host_malloc import keep_freed_buffers
from pdserve.kernels import cpu_native, reference


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--context", type=int, default=576, help="tokens per sequence (about)")
    ap.add_argument("--heads", default="9,3,64", help="H_q,H_kv,D (default: SmolLM2-135M)")
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--repeats", type=int, default=30)
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
    block, layers = args.block_size, 30
    batches = [int(b) for b in args.batches.split(",")]
    blocks_per_seq = -(-args.context // block)
    num_blocks = max(batches) * blocks_per_seq + 1
    gen = torch.Generator().manual_seed(0)
    cache = torch.randn(num_blocks, layers, 2, num_kv_heads, block, head_dim, generator=gen)
    views = [cache[:, i] for i in range(layers)]
    scale = head_dim**-0.5
    rows = []
    for batch in batches:
        lens = torch.randint(args.context - block + 1, args.context + 1, (batch,), generator=gen)
        tables = torch.randperm(num_blocks - 1, generator=gen)[: batch * blocks_per_seq] + 1
        tables = tables.view(batch, blocks_per_seq).to(torch.int32)
        q = torch.randn(batch, num_heads, head_dim, generator=gen)
        ref, native, ratio = paired_ms(
            lambda i, a=(q, lens, tables): reference.decode_attention(
                a[0], views[i % layers], a[1], a[2], scale
            ),
            lambda i, a=(q, lens, tables): cpu_native.decode_attention(
                a[0], views[i % layers], a[1], a[2], scale, None, module
            ),
            args.repeats,
            time.process_time if args.cpu_time else time.perf_counter,
        )
        kv_bytes = int(lens.sum()) * 2 * num_kv_heads * head_dim * 4
        rows.append({"batch": batch, "reference_ms": round(ref, 3), "native_ms": round(native, 3),
                     "speedup": round(ratio, 2), "kv_mb": round(kv_bytes / 1e6, 2),
                     "native_gb_s": round(kv_bytes / native / 1e6, 1)})  # fmt: skip
    print(f"build: {module.isa()}; torch CPU capability: {torch.backends.cpu.get_cpu_capability()}; "
          f"load average {load_before} -> {os.getloadavg()}")  # fmt: skip
    print(
        "| batch | K+V read (MB) | reference (ms) | compiled (ms) | speedup | compiled reads at (GB/s) |"
    )
    print("| --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['batch']} | {r['kv_mb']} | {r['reference_ms']} | {r['native_ms']} | "
              f"{r['speedup']}x | {r['native_gb_s']} |")  # fmt: skip
    if args.json:
        config = {**provenance(), **vars(args), "cpu_count": os.cpu_count(),
                  **cpu_native.describe(), "build_isa": module.isa(),
                  "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
                  "load_average_before": load_before, "load_average_after": os.getloadavg(),
                  "env": {k: os.environ[k] for k in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA",
                          "MKL_ENABLE_INSTRUCTIONS", "OMP_NUM_THREADS") if k in os.environ}}  # fmt: skip
        with open(args.json, "w") as f:
            json.dump({"benchmark": "cpu_decode_attention", "config": config, "rows": rows}, f,
                      indent=1)  # fmt: skip


if __name__ == "__main__":
    main()
