"""One MoE layer's routed experts at decode batch sizes on one GPU: the grouped-GEMM path
(kernels/moe_grouped.py, what every batch took before) against the decode kernels
(kernels/triton_moe_decode.py, what ``kernels.moe_experts`` takes at T*k <= MAX_PAIRS),
both against the bytes floor of the experts the batch touches.

    python benchmarks/moe_decode.py                        # 30b-a3b and v4-flash, batch 1,4,16
    python benchmarks/moe_decode.py --json /tmp/out/moe_decode.json
    python benchmarks/moe_decode.py --shapes 30b-a3b --batch-sizes 1,16 --sweep   # tiles
    TRITON_INTERPRET=1 python benchmarks/moe_decode.py --device cpu --shapes tiny \
        --batch-sizes 1,4                                  # a smoke run, no GPU

Shapes (bf16 on CUDA): 30b-a3b is Qwen3-30B-A3B's layer (128 experts of 768, 8 a token,
hidden 2048); v4-flash DeepSeek-V4-Flash's (256 experts of 2048, 6 a token, hidden 4096,
swiglu limit 10: 12.9 GB of experts). Each path is captured in a CUDA graph of one call
(as a decode step replays it) and timed by ``triton.testing.do_bench`` (median, L2 flushed
between calls). The floor: the touched experts' bytes (3 x H x I each) over the device's
copy rate (read + write, as ``pdserve bench engine`` counts it). ``diff``: the largest
difference between the two paths' outputs over the largest output. ``--sweep`` times the
decode kernels under other tile sizes (one kernel's at a time, the other's default).
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.moe_ep import _copy_gbps  # noqa: E402  (the copy-rate probe, once)
from pdserve.kernels import moe_grouped, triton_moe_decode  # noqa: E402

# name: (experts, top_k, hidden, intermediate, swiglu limit)
SHAPES: dict[str, tuple[int, int, int, int, float | None]] = {
    "30b-a3b": (128, 8, 2048, 768, None),
    "v4-flash": (256, 6, 4096, 2048, 10.0),
    "tiny": (16, 3, 64, 40, None),
}

SWEEP_GATE_UP = [
    {"block_i": bi, "block_h": bh, "stages_gate_up": st}
    for bi in (16, 32)
    for bh in (128, 256)
    for st in (2, 3, 4)
]
SWEEP_DOWN = [
    {"block_o": bo, "block_k": bk, "stages_down": st}
    for bo in (16, 32)
    for bk in (128, 256, 512)
    for st in (3, 4, 5)
]


def _timed(fn: Callable[[], torch.Tensor], device: torch.device) -> tuple[float, torch.Tensor]:
    """(microseconds of one call, its output): on CUDA a graph of one call, replayed under
    do_bench; elsewhere the median of 3 eager calls."""
    if device.type != "cuda":
        times = []
        for _ in range(3):
            start = time.perf_counter()
            out = fn()
            times.append((time.perf_counter() - start) * 1e6)
        return statistics.median(times), out
    import triton

    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        fn()  # compile and warm outside the capture
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    ms = triton.testing.do_bench(graph.replay, warmup=10, rep=40, return_mode="median")
    return float(ms) * 1e3, out


def _inputs(
    name: str, tokens: int, dtype: torch.dtype, device: torch.device, weights: dict[str, Any]
) -> tuple[torch.Tensor, ...]:
    experts, top_k, hidden, inter, _ = SHAPES[name]
    if name not in weights:  # one set a shape (v4-flash: 12.9 GB), drawn on the device
        weights.clear()
        weights[name] = (
            torch.empty(experts, 2 * inter, hidden, dtype=dtype, device=device).normal_(0, 0.02),
            torch.empty(experts, hidden, inter, dtype=dtype, device=device).normal_(0, 0.02),
        )
    gen = torch.Generator(device=device).manual_seed(tokens)
    ids = torch.rand(tokens, experts, generator=gen, device=device).topk(top_k, dim=-1)[1]
    w = torch.rand(tokens, top_k, generator=gen, device=device)
    x = torch.randn(tokens, hidden, generator=gen, device=device).to(dtype)
    return (x, ids, w / w.sum(-1, keepdim=True), *weights[name])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--shapes", default="30b-a3b,v4-flash")
    p.add_argument("--batch-sizes", default="1,4,16")
    p.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 elsewhere")
    p.add_argument("--sweep", action="store_true")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    copy = _copy_gbps(device)
    rows: list[dict[str, Any]] = []
    sweeps: list[dict[str, Any]] = []
    weights: dict[str, Any] = {}
    print(f"copy rate {copy:.0f} GB/s (read + write), {dtype}")
    print(
        f"{'shape':>9} {'T':>3} {'pairs':>5} {'touched':>7} {'floor us':>8} {'grouped us':>10} "
        f"{'decode us':>9} {'grp/floor':>9} {'dec/floor':>9} {'diff':>8}"
    )
    for name in args.shapes.split(","):
        experts, top_k, hidden, inter, limit = SHAPES[name]
        for tokens in [int(t) for t in args.batch_sizes.split(",")]:
            x, ids, w, gate_up, down = _inputs(name, tokens, dtype, device, weights)
            touched = int(ids.unique().numel())
            floor_us = touched * 3 * hidden * inter * gate_up.element_size() / (copy * 1e3)
            inputs = (x, ids, w, gate_up, down, 0, limit)
            grouped_us, want = _timed(functools.partial(moe_grouped.moe_experts, *inputs), device)
            decode = functools.partial(triton_moe_decode.moe_experts, *inputs)
            decode_us, got = _timed(decode, device)
            diff = ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()
            row = {
                "shape": name, "tokens": tokens, "pairs": tokens * top_k, "touched": touched,
                "floor_us": floor_us, "grouped_us": grouped_us, "decode_us": decode_us,
                "grouped_over_floor": grouped_us / floor_us, "decode_over_floor": decode_us / floor_us,
                "decode_gbps": touched * 3 * hidden * inter * gate_up.element_size() / decode_us / 1e3,
                "diff": diff, "fits": triton_moe_decode.fits(x, ids, gate_up),
            }  # fmt: skip
            rows.append(row)
            print(
                f"{name:>9} {tokens:>3} {tokens * top_k:>5} {touched:>7} {floor_us:>8.1f} "
                f"{grouped_us:>10.1f} {decode_us:>9.1f} {grouped_us / floor_us:>8.2f}x "
                f"{decode_us / floor_us:>8.2f}x {diff:>8.1e}"
            )
            if args.sweep:
                for tiles in SWEEP_GATE_UP + SWEEP_DOWN:
                    try:
                        us, _ = _timed(functools.partial(decode, tiles=tiles), device)
                    except Exception as e:  # noqa: BLE001 (a tile that does not compile)
                        print(f"    {tiles}: {type(e).__name__}")
                        continue
                    sweeps.append({"shape": name, "tokens": tokens, "tiles": tiles, "us": us})
                    print(f"    {tiles}: {us:.1f} us ({us / floor_us:.2f}x floor)")
    if args.json is not None:
        from pdserve.cli.provenance import git_commit

        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(
            json.dumps(
                {
                    "commit": git_commit(),
                    "device": torch.cuda.get_device_name(device)
                    if device.type == "cuda"
                    else "cpu",
                    "copy_gbps": copy,
                    "dtype": str(dtype),
                    "rows": rows,
                    "sweep": sweeps,
                },
                indent=1,
            )
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
