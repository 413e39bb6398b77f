"""Prefill latency against prompt length for PCP = 1, 2, 4 (real rank processes, gloo).

    python benchmarks/pcp_prefill.py --lengths 1024,4096 --pcp 1,2,4 --json benchmarks/results/pcp_cpu.json

PCP = 1 runs the in-process ModelRunner; N > 1 a RankGroup of N rank processes, each
with one torch thread per rank (on a 2-core machine more ranks share the same cores, so
the table shows the cost of the split, not a speed-up: that needs one device per rank).
Writes a table, JSON and, with --plot, a PNG (matplotlib if installed).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import time
from pathlib import Path

import torch

from pdserve.cli.provenance import provenance
from pdserve.common.engine.config import EngineConfig
from pdserve.common.engine.model_runner import ModelRunner
from pdserve.common.engine.step_plan import ScheduledSeq, StepPlan
from pdserve.common.model.checkpoint.config import ModelConfig
from pdserve.common.model.checkpoint.files import resolve_model
from pdserve.services.ranks.group import RankGroup


def plans(length: int, chunk: int, block_size: int) -> list[StepPlan]:
    ids = torch.randint(
        100, 40000, (length,), generator=torch.Generator().manual_seed(length)
    ).tolist()
    blocks = list(range(-(-length // block_size)))
    out = []
    for start in range(0, length, chunk):
        end = min(length, start + chunk)
        out.append(StepPlan([ScheduledSeq("r", ids[start:end], start, blocks, end == length)]))
    return out


def time_prefill(runner: object, length: int, chunk: int, block_size: int, repeats: int) -> float:
    samples = []
    for _ in range(repeats):
        started = time.perf_counter()
        for plan in plans(length, chunk, block_size):
            logits = runner.execute(plan)  # type: ignore[attr-defined]
        float(logits.sum())  # waits for the device
        samples.append(time.perf_counter() - started)
    return statistics.median(samples)


def time_pulls(group: RankGroup, device: str, repeats: int = 5) -> dict[str, float]:
    """Seconds to pull every block of the cache from replica 0 vs striped over all replicas
    (a decode-side NIXL agent in this process, READs as the decode service issues them)."""
    import msgspec

    from pdserve.common.runtime import protocol as p
    from pdserve.common.transfer.kv_consumer import KVConsumer

    layout = group.layout
    cache = torch.zeros(layout.shape, dtype=getattr(torch, layout.dtype), device=device)
    consumer = KVConsumer(
        agent_name="bench-decode",
        kv_cache=cache,
        layout=layout,
        compat=group.handshake_replies[0].compat,
    )
    try:
        for reply in group.handshake_replies:
            consumer.connect(reply)
        first = group.handshake_replies[0]
        blocks = list(range(layout.num_blocks))
        handle = p.KVHandle(
            engine_id=first.engine_id,
            epoch=first.epoch,
            layout=layout,
            block_ids=blocks,
            num_tokens=len(blocks) * layout.block_size,
            replicas=[
                p.Replica(agent_name=r.agent_name, side_channel="", pcp_rank=i)
                for i, r in enumerate(group.handshake_replies)
            ],
            lease_deadline=0.0,
        )
        out = {}
        for mode, parts in (("first", 1), ("striped", len(group.handshake_replies))):
            samples = []
            for _ in range(repeats):
                bounds = [len(blocks) * i // parts for i in range(parts + 1)]
                started = time.perf_counter()
                pulls = [
                    consumer.start_pull(
                        "bench",
                        msgspec.structs.replace(handle, block_ids=blocks[a:b]),
                        blocks[a:b],
                        i,
                    )
                    for i, (a, b) in enumerate(itertools.pairwise(bounds))
                ]
                while not all(consumer.poll(pull) for pull in pulls):
                    pass
                samples.append(time.perf_counter() - started)
            out[mode] = statistics.median(samples)
        out["bytes"] = float(layout.total_bytes)
        return out
    finally:
        consumer.close()


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default=None)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--lengths", default="1024,2048,4096")
    ap.add_argument("--pcp", default="1,2,4")
    ap.add_argument("--chunk", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--json", default=None)
    ap.add_argument("--plot", default=None)
    args = ap.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    model_dir = resolve_model(args.model)
    blocks = -(-max(lengths) // 64) + 1
    cfg = EngineConfig(
        model=str(model_dir),
        device=args.device,
        num_kv_blocks=blocks,
        max_num_batched_tokens=args.chunk,
    )
    rows: list[dict[str, float]] = []
    pulls: list[dict[str, float]] = []
    for n in [int(x) for x in args.pcp.split(",")]:
        if n == 1:
            torch.set_num_threads(int(os.environ.get("PDSERVE_RANK_THREADS", "1")))
            runner: object = ModelRunner.from_config(
                ModelConfig.from_dir(model_dir), model_dir, cfg
            )
        else:
            runner = RankGroup.prefill(cfg, n, f"bench-pcp{n}", 1)
        try:
            time_prefill(runner, min(lengths), args.chunk, 64, 1)  # warm-up
            for length in lengths:
                seconds = time_prefill(runner, length, args.chunk, 64, args.repeats)
                rows.append(
                    {
                        "pcp": n,
                        "tokens": length,
                        "seconds": seconds,
                        "tokens_per_s": length / seconds,
                    }
                )
                print(
                    f"pcp {n}  tokens {length:6d}  {seconds * 1000:9.1f} ms  {length / seconds:9.1f} tok/s",
                    flush=True,
                )
            if isinstance(runner, RankGroup):
                t = time_pulls(runner, args.device)
                pulls.append({"pcp": n, **t})
                gb = t["bytes"] / 1e9
                print(
                    f"pcp {n}  pull {gb:.3f} GB  first {t['first'] * 1000:.1f} ms ({gb / t['first']:.2f} GB/s)"
                    f"  striped {t['striped'] * 1000:.1f} ms ({gb / t['striped']:.2f} GB/s)",
                    flush=True,
                )
        finally:
            if isinstance(runner, RankGroup):
                runner.close()
    result = {
        **provenance(),
        "model": str(model_dir),
        "device": args.device,
        "cpu_count": os.cpu_count(),
        "chunk": args.chunk,
        "torch": torch.__version__,
        "rows": rows,
        "pulls": pulls,
    }
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        for n in sorted({r["pcp"] for r in rows}):
            pts = [r for r in rows if r["pcp"] == n]
            plt.plot(
                [r["tokens"] for r in pts],
                [r["seconds"] for r in pts],
                marker="o",
                label=f"PCP={n}",
            )
        plt.xlabel("prompt tokens")
        plt.ylabel("prefill seconds")
        plt.legend()
        plt.savefig(args.plot, dpi=100)


if __name__ == "__main__":
    main()
