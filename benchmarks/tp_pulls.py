"""KV pulls between tensor-parallel layouts: time and descriptors per request.

For each (prefill TP, decode TP) pairing, prefill TP producer processes each serve their
KV heads of an N-token prompt (the real KVProducer over our head-major layout); the
decode TP consumer agents (the real KVConsumer, in this process) read the heads each
decode rank holds, as services/decode/pullers.py plans them, all ranks at once. The
bytes are checked against the producers' content, and the wall time of the whole pull
(every decode rank done) and the descriptors are reported, with one raw READ of the same
bytes as a single descriptor as the ceiling (same producer, same run).

    python benchmarks/tp_pulls.py --tokens 4096 16384 --json benchmarks/results/tp_pulls_cpu.json

1B-shaped KV (Llama-3.2-1B: 16 layers, 8 KV heads, head_dim 64, bf16) by default.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import sys
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import msgspec

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a source checkout

from pdserve.cli.provenance import provenance
from pdserve.common.engine.kv_layout import KVLayout
from pdserve.common.parallel.tp import kv_heads_of

SHAPE = {"num_layers": 16, "num_kv_heads": 8, "head_dim": 64}
ENGINE, EPOCH = "bench-tp", 1
COMPAT = {"model": "bench-tp", "num_kv_heads": SHAPE["num_kv_heads"]}


def layout_for(tp: int, rank: int, num_blocks: int) -> KVLayout:
    heads = kv_heads_of(SHAPE["num_kv_heads"], tp, rank)[1]
    return KVLayout(
        num_blocks=num_blocks,
        num_layers=SHAPE["num_layers"],
        num_kv_heads=heads,
        block_size=64,
        head_dim=SHAPE["head_dim"],
        dtype="bfloat16",
    )


def value(global_head: int, block: int) -> float:
    return float((global_head * 31 + block) % 251)  # exact in bfloat16


def producer_main(tp: int, rank: int, num_blocks: int, conn: Connection) -> None:
    import torch

    from pdserve.common.engine.kv_cache import new_cache
    from pdserve.common.runtime.protocol import encode
    from pdserve.common.transfer.kv_transfer import KVProducer

    torch.set_num_threads(1)
    layout = layout_for(tp, rank, num_blocks)
    cache = new_cache(layout)
    first = kv_heads_of(SHAPE["num_kv_heads"], tp, rank)[0]
    for h in range(layout.num_kv_heads):
        for b in range(num_blocks):
            cache[b, :, :, h] = value(first + h, b)
    producer = KVProducer(
        engine_id=ENGINE,
        epoch=EPOCH,
        agent_name=f"{ENGINE}-r{rank}",
        kv_cache=cache,
        layout=layout,
        compat=COMPAT,
        tp_rank=rank,
        tp_size=tp,
    )
    conn.send_bytes(encode(producer.handshake_reply))
    while not conn.poll(0.01):
        producer.poll_releases()
    producer.close()


def pull_once(consumers: list[Any], handle: Any, local: list[int], dtp: int) -> tuple[float, int]:
    from pdserve.common.transfer.nixl_backend import start_pulls
    from pdserve.services.decode.pullers import plan_pulls

    plan = plan_pulls(handle, local, SHAPE["num_kv_heads"], dtp, striped=False)
    started = time.perf_counter()
    pulls = [
        (c, start_pulls(c, "r", handle, specs)) for c, specs in zip(consumers, plan, strict=True)
    ]
    pending = [(c, p) for c, ps in pulls for p in ps]
    while pending:
        pending = [(c, p) for c, p in pending if not c.poll(p)]
    seconds = time.perf_counter() - started
    return seconds, sum(p.num_descriptors for _, ps in pulls for p in ps)


def ceiling(consumer: Any, handle: Any, num_bytes: int) -> float:
    """One READ of the same byte count as a single descriptor, from producer rank 0."""
    agent, remote = (
        consumer._agent,
        consumer._remotes[(ENGINE, EPOCH, handle.replicas[0].agent_name)],
    )
    size = min(num_bytes, remote.reply.layout.total_bytes, consumer.layout.total_bytes)
    local = agent.get_xfer_descs([(consumer.kv_cache.data_ptr(), size, 0)], "DRAM")
    from pdserve.common.transfer.kv_transfer import nixl_handshake

    base = nixl_handshake(remote.reply).base_address
    far = agent.get_xfer_descs([(base, size, 0)], "DRAM")
    xfer = agent.initialize_xfer("READ", local, far, remote.reply.agent_name)
    started = time.perf_counter()
    agent.transfer(xfer)
    while agent.check_xfer_state(xfer) == "PROC":
        pass
    seconds = time.perf_counter() - started
    agent.release_xfer_handle(xfer)
    return size / seconds / 1e9


def run(tokens_list: list[int], tps: list[int], repeats: int) -> list[dict[str, Any]]:
    import torch

    from pdserve.common.engine.kv_cache import new_cache
    from pdserve.common.runtime.protocol import HandshakeReply, KVHandle, Replica
    from pdserve.common.transfer.kv_consumer import KVConsumer

    torch.set_num_threads(1)
    rows = []
    max_blocks = -(-max(tokens_list) // 64)
    ctx = mp.get_context("spawn")
    for ptp in tps:
        conns, procs = [], []
        for rank in range(ptp):
            parent, child = ctx.Pipe()
            proc = ctx.Process(
                target=producer_main, args=(ptp, rank, max_blocks, child), daemon=True
            )
            proc.start()
            conns.append(parent)
            procs.append(proc)
        replies = [msgspec.msgpack.decode(c.recv_bytes(), type=HandshakeReply) for c in conns]
        for dtp in tps:
            consumers = [
                KVConsumer(
                    agent_name=f"bench-decode-{ptp}-{dtp}-{d}",
                    kv_cache=new_cache(layout_for(dtp, d, max_blocks)),
                    layout=layout_for(dtp, d, max_blocks),
                    compat=COMPAT,
                )
                for d in range(dtp)
            ]
            for c in consumers:
                for r in replies:
                    c.connect(r)
            for tokens in tokens_list:
                n = -(-tokens // 64)
                ids = list(range(n))
                handle = KVHandle(
                    engine_id=ENGINE,
                    epoch=EPOCH,
                    layout=replies[0].layout,
                    block_ids=ids,
                    num_tokens=tokens,
                    replicas=[
                        Replica(agent_name=r.agent_name, side_channel="", tp_rank=r.tp_rank)
                        for r in replies
                    ],
                    lease_deadline=0.0,
                )
                times, descriptors = [], 0
                for _ in range(repeats):
                    seconds, descriptors = pull_once(consumers, handle, ids, dtp)
                    times.append(seconds)
                for d, c in enumerate(consumers):  # every head of every block arrived
                    first = kv_heads_of(SHAPE["num_kv_heads"], dtp, d)[0]
                    for h in range(c.layout.num_kv_heads):
                        got = c.kv_cache[ids, 0, 0, h, 0, 0].float().tolist()
                        assert got == [value(first + h, b) for b in ids], (ptp, dtp, d, h)
                num_bytes = n * layout_for(1, 0, 1).block_bytes
                seconds = statistics.median(times)
                ceil = ceiling(consumers[0], handle, num_bytes)
                rows.append(
                    {
                        "prefill_tp": ptp,
                        "decode_tp": dtp,
                        "tokens": tokens,
                        "blocks": n,
                        "bytes": num_bytes,
                        "descriptors": descriptors,
                        "seconds": seconds,
                        "gbps": num_bytes / seconds / 1e9,
                        "ceiling_gbps": ceil,
                        "repeats": repeats,
                        "times": times,
                    }
                )
                r = rows[-1]
                print(
                    f"{ptp:>10} {dtp:>9} {tokens:>7} {r['bytes'] / 2**20:>8.0f} {descriptors:>11} "
                    f"{seconds * 1e3:>9.2f} {r['gbps']:>8.2f} {ceil:>8.2f}",
                    flush=True,
                )
            for c in consumers:
                c.close()
        for c in conns:
            c.send_bytes(b"stop")
        for proc in procs:
            proc.join(10)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[4096, 16384])
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    print(
        f"{'prefill TP':>10} {'decode TP':>9} {'tokens':>7} {'MiB':>8} {'descriptors':>11} {'ms':>9} {'GB/s':>8} {'ceil GB/s':>8}"
    )
    rows = run(args.tokens, args.tp, args.repeats)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(
            json.dumps(
                {
                    "shape": SHAPE,
                    "dtype": "bfloat16",
                    "block_size": 64,
                    "device": "cpu",
                    **provenance(),
                    "rows": rows,
                },
                indent=1,
            )
        )


if __name__ == "__main__":
    main()
