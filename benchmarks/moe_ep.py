"""One MoE layer under expert parallelism over N ranks: time per forward against its floor.

    python benchmarks/moe_ep.py --ranks 1,2,4,8 --tokens 1,16,64,256,1024 \
        --json benchmarks/results/moe_ep.json          # CUDA: one GPU a rank, NCCL
    python benchmarks/moe_ep.py --device cpu --ranks 1,2 --hidden 256 --inter 128 \
        --experts 16 --top-k 4 --tokens 1,16            # CPU smoke: gloo

Each of N rank processes holds E / N whole experts of a Qwen3-30B-A3B-like layer (default
128 experts of 768, 8 a token, hidden 2048, bf16) and the replicated router, as the engine's
``SparseMoeBlock`` does under TP N; every rank gets the same T tokens (TP attention leaves
them replicated), routes them, runs its experts (grouped GEMM on CUDA) and the all-reduce
sums the ranks' shares. A forward's memory floor is the slowest rank's bytes of touched
experts over the device's copy rate (read + write, as ``pdserve bench engine`` counts it).
Ranks beyond the GPUs present are skipped with a note; nothing else changes with N.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import time
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

from pdserve.common.model.checkpoint.moe_config import MoEConfig
from pdserve.common.model.layers.moe import SparseMoeBlock
from pdserve.common.parallel.context import init_grid


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _copy_gbps(device: torch.device) -> float:
    src = torch.empty(2**30 if device.type == "cuda" else 2**26, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(5):
        _sync(device)
        start = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        best = min(best, time.perf_counter() - start)
    return 2 * src.numel() / best / 1e9


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _rank(rank: int, n: int, port: int, args: argparse.Namespace, out: Any) -> None:
    import torch.distributed as dist

    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_device(rank)
    device = torch.device(f"cuda:{rank}" if cuda else "cpu")
    dist.init_process_group(
        "nccl" if cuda else "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=n,
        **({"device_id": device} if cuda else {}),
    )
    try:
        moe = MoEConfig(
            num_experts=args.experts,
            top_k=args.top_k,
            intermediate_size=args.inter,
            norm_topk_prob=True,
            sparse_layers=(0,),
        )
        dtype = getattr(torch, args.dtype)
        torch.manual_seed(rank)
        with torch.device(device):
            block = SparseMoeBlock(args.hidden, moe, init_grid(n, 1, rank)).to(dtype)
        torch.manual_seed(0)  # the router is replicated: the same on every rank
        block.gate.weight.data.normal_(0, 0.02)
        for p in (block.experts.gate_up_proj, block.experts.down_proj):
            p.data.normal_(0, 0.02)
        block.touched = torch.zeros(args.experts, dtype=torch.bool, device=device)
        per_expert = 3 * args.hidden * args.inter * block.experts.gate_up_proj.element_size()
        first, count = block.experts.first, block.experts.gate_up_proj.shape[0]
        copy = _copy_gbps(device)
        rows = []
        for tokens in args.tokens:
            gen = torch.Generator(device=device).manual_seed(tokens)
            x = torch.randn(tokens, args.hidden, generator=gen, device=device).to(dtype)
            with torch.inference_mode():
                for _ in range(args.warmup):
                    block(x)
                block.touched.zero_()
                block(x)
                mine = int(block.touched[first : first + count].sum())
                _sync(device)
                dist.barrier()
                start = time.perf_counter()
                for _ in range(args.iters):
                    block(x)
                _sync(device)
                ms = (time.perf_counter() - start) / args.iters * 1e3
            stats = torch.tensor([ms, mine * per_expert / (copy * 1e9) * 1e3, mine], device=device)
            parts = [torch.empty_like(stats) for _ in range(n)]
            dist.all_gather(parts, stats)
            if rank == 0:
                per_rank = torch.stack(parts).cpu()
                step = float(per_rank[:, 0].max())
                floor = float(per_rank[:, 1].max())
                rows.append(
                    {
                        "ranks": n,
                        "tokens": tokens,
                        "forward_ms": step,
                        "floor_ms": floor,
                        "over_floor": step / floor if floor else None,
                        "experts_touched_per_rank": [int(v) for v in per_rank[:, 2]],
                        "copy_gbps": copy,
                    }
                )
        if rank == 0:
            out.put(rows)
    finally:
        dist.destroy_process_group()


def run(n: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank, args=(r, n, port, args, out)) for r in range(n)]
    for p in procs:
        p.start()
    rows: list[dict[str, Any]] = out.get(timeout=1800)
    for p in procs:
        p.join()
    if any(p.exitcode for p in procs):
        raise SystemExit(f"a rank of {n} failed: exit codes {[p.exitcode for p in procs]}")
    return rows


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--ranks", type=_ints, default=[1, 2, 4, 8])
    p.add_argument("--tokens", type=_ints, default=[1, 16, 64, 256, 1024])
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--inter", type=int, default=768)
    p.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    available = torch.cuda.device_count() if args.device == "cuda" else max(args.ranks)
    rows: list[dict[str, Any]] = []
    for n in args.ranks:
        if args.experts % n:
            print(f"ranks {n}: {args.experts} experts do not split over {n}; skipped")
        elif n > available:
            print(f"ranks {n}: only {available} GPUs here; skipped (not run)")
        else:
            rows += run(n, args)
    print(f"{'ranks':>5} {'tokens':>6} {'forward ms':>10} {'floor ms':>9} {'x floor':>7}  touched")
    for r in rows:
        ratio = f"{r['over_floor']:.2f}x" if r["over_floor"] else "-"
        print(
            f"{r['ranks']:>5} {r['tokens']:>6} {r['forward_ms']:>10.3f} {r['floor_ms']:>9.3f} "
            f"{ratio:>7}  {r['experts_touched_per_rank']}"
        )
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"config": vars(args) | {"json": None}, "rows": rows}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
