"""``pdserve bench transfer``: KV pull throughput of the real KVProducer / KVConsumer
against the ceilings measured in the same run.

    pdserve bench transfer --shape 1b,8b --json benchmarks/results/transfer_cpu.json
    pdserve bench transfer --device cuda --shape 1b,8b --json benchmarks/results/transfer_h200.json

Per shape, two processes (forked from a preloaded forkserver; on cuda both on the one GPU)
each hold a KV cache of our real layout (``KVLayout``, block size 64, bfloat16): ``1b`` is
Llama-3.2-1B (16 layers, 8 KV heads, head_dim 64: 2 MiB a block), ``8b`` Llama-3.1-8B (32
layers, 8 KV heads, head_dim 128: 8 MiB a block). The consumer pulls the KV of an N-token prompt as decode
does (handshake reply -> connect -> start_pull -> poll -> release): once into a zeroed
cache, checked against the producer's content, then --repeats timed pulls. Each repeat
also times, on the same bytes:

* ceiling: one NIXL READ of the whole byte range as a single descriptor (a plain agent,
  same UCX settings, timed as a pull is: prepared lists, make_prepped_xfer, poll);
* copy: a local torch copy (device-to-device on cuda; one memcpy stream on cpu).

A pull completes only once the producer's agent has made progress after the previous
pull's release notification (NIXL/UCX: the notification waits on the same endpoint), so a
producer busy between progress calls delays every pull but the first by up to that long:
--producer-poll-ms sets how often the producer progresses (a prefill worker does so
between engine steps). Repeats alternate which of pull and ceiling goes first. The first pull of each row is an
untimed warm-up (``first_pull_ms``; the very first one also pays the UCX connection).

GB/s = bytes moved / seconds (1e9 bytes; a copy's bytes counted once, not read +
written), the median of the repeats; ratio = pull GB/s / ceiling GB/s. Pull time is
``Pull.transfer_seconds``: from building the request until poll saw it done.

Orders (--order, common/engine/kv_layout.py): ``head``-major storage costs one descriptor per
(KV head, run of blocks) and lets a reader take any head slice; ``block``-major costs one
per run when the reader takes every head (equal TP on both sides), which is what a
deployment with equal prefill and decode TP uses.

Patterns: ``contiguous`` pulls remote blocks 0..n-1 (one run); ``fragmented`` pulls
remote runs of --fragment blocks with equal gaps (1 = every other block) into contiguous
local blocks, so there are as many runs as ceil(n / K): descriptors follow runs.
Descriptors: ours (``Pull.num_descriptors``) and NIXL's own (transfer telemetry).

Memory: each side's cache holds twice the largest pull (the fragmented ids span twice
the blocks; the consumer's second half is the copy's destination), so a shape needs 4x
the bytes of its largest pull: 8b at 8k tokens is 1 GiB a pull, 4 GiB in all. cpu
defaults stay within a 24 GiB machine (1b: 1k-16k tokens, 8b: 1k-8k); cuda defaults go to
32k. --tokens overrides both; a run that would not fit the available memory is refused.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import time
from pathlib import Path
from typing import Any

from pdserve.cli.bench.arg_types import positive_int, positive_ints
from pdserve.cli.engine_flags import add_kv_cache_dtype
from pdserve.cli.provenance import provenance

DTYPE = "bfloat16"  # --kv-cache-dtype auto's stored dtype (cli/bench/transfer_cache.py's)
DEFAULT_TOKENS = {
    ("cpu", "1b"): [1024, 4096, 8192, 16384],
    ("cpu", "8b"): [1024, 4096, 8192],
    ("cuda", "1b"): [1024, 4096, 8192, 16384, 32768],
    ("cuda", "8b"): [1024, 4096, 8192, 16384, 32768],
}
# The two processes fork from a server that imported these once (multiprocessing's
# forkserver, as rank processes do), not each from a fresh interpreter (~2 s of CPU each).
PEER_PRELOAD = ["torch", "pdserve.common.transfer.nixl_libs", "pdserve.cli.bench.transfer_peers"]
START_WAIT_S = 300.0  # a fresh forkserver's imports + filling the cache, on a loaded machine
ROW_WAIT_S = 600.0


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "transfer",
        help="KV pull GB/s of KVProducer/KVConsumer vs a one-descriptor NIXL READ",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    add_kv_cache_dtype(p, default="auto")  # auto: bfloat16, the GPU engine's dtype
    p.add_argument(
        "--shape", type=_shapes, default=["1b"], help="1b, 8b, dsv3 (MLA latent) or a comma list"
    )
    p.add_argument(
        "--tokens",
        type=positive_ints,
        default=None,
        help="comma-separated prompt lengths, e.g. 1024,8192 (default: per device, shape)",
    )
    p.add_argument(
        "--fragment",
        type=_fragments,
        default=[1],
        help="run lengths (blocks) of the fragmented rows, e.g. 1,8; 'none': no such rows",
    )
    p.add_argument(
        "--order",
        type=_orders,
        default=["head", "block"],
        help="KV storage orders to measure (common/engine/kv_layout.py): head, block or head,block",
    )
    p.add_argument(
        "--repeats",
        type=positive_int,
        default=5,
        help="timed repeats per row (the median is reported)",
    )
    p.add_argument(
        "--producer-poll-ms",
        type=float,
        default=5.0,
        help="the producer progresses its NIXL agents every this many ms (0: spins), as "
        "a prefill worker does between engine steps; a pull after a release waits for it",
    )
    p.add_argument(
        "--num-threads",
        type=int,
        default=0,
        help="NIXL UCX backend threads (nixl_agent_config num_threads; 0: default)",
    )
    p.add_argument(
        "--json",
        type=Path,
        default=None,
        metavar="FILE",
        help="also write the config and rows here",
    )
    p.set_defaults(run=run)


def _fragments(text: str) -> list[int]:
    return [] if text.strip().lower() == "none" else positive_ints(text)


def _orders(text: str) -> list[str]:
    from pdserve.common.engine.kv_layout import ORDERS

    orders = [s.strip().lower() for s in text.split(",") if s.strip()]
    if not orders or any(o not in ORDERS for o in orders):
        raise argparse.ArgumentTypeError(f"orders are {', '.join(ORDERS)}; got {text!r}")
    return orders


def _shapes(text: str) -> list[str]:
    from pdserve.cli.bench.transfer_cache import SHAPES

    shapes = [s.strip().lower() for s in text.split(",") if s.strip()]
    bad = [s for s in shapes if s not in SHAPES]
    if bad or not shapes:
        raise argparse.ArgumentTypeError(f"shapes are {', '.join(SHAPES)}; got {text!r}")
    return shapes


def progress(message: str) -> None:
    print(f"bench transfer: {message}", file=sys.stderr, flush=True)


# -- the two processes --------------------------------------------------------------------


class _Peer:
    """One peer process and its pipe; every wait is bounded and names who failed."""

    def __init__(self, ctx: Any, who: str, target: Any, spec: dict[str, Any]) -> None:
        self.who = who
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=target, args=(child, spec), daemon=True, name=f"bench-{who}")
        self.proc.start()
        child.close()

    def expect(self, kinds: tuple[str, ...], wait_s: float, what: str) -> tuple[str, Any]:
        from pdserve.common.errors import PdserveError

        deadline = time.monotonic() + wait_s
        while not self.conn.poll(0.2):
            if not self.proc.is_alive():
                raise PdserveError(f"the {self.who} process exited (code {self.proc.exitcode}) "
                                   f"while the benchmark waited for {what}")  # fmt: skip
            if time.monotonic() > deadline:
                raise PdserveError(f"the {self.who} process gave no {what} within {wait_s:.0f} s")
        kind, value = self.conn.recv()
        if kind == "error":
            raise PdserveError(f"the {self.who} process failed during {what}:\n{value}")
        if kind not in kinds:
            raise PdserveError(f"the {self.who} process sent {kind!r} while {what} was expected")
        return kind, value

    def stop(self) -> None:
        try:
            self.conn.send(("stop", None))
        except (OSError, ValueError):
            pass
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.terminate()
            self.proc.join(5)


def run_shape(
    device: str, shape: str, order: str, tokens: list[int], args: argparse.Namespace
) -> dict[str, Any]:
    """Spawn producer and consumer for one shape and order; return its rows and what they said."""
    from pdserve.cli.bench.transfer_cache import cache_blocks
    from pdserve.cli.bench.transfer_peers import consumer_main, producer_main
    from pdserve.common.errors import PdserveError

    spec = {
        "device": device, "shape": shape, "order": order, "tokens": tokens, "fragment": args.fragment,
        "repeats": args.repeats, "num_threads": args.num_threads, "producer_poll_ms": args.producer_poll_ms,
        "num_blocks": cache_blocks(shape, max(tokens)),
        "dtype": kv_dtype_of(args.kv_cache_dtype),
    }  # fmt: skip
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PEER_PRELOAD)
    producer = _Peer(ctx, "producer", producer_main, spec)
    consumer = _Peer(ctx, "consumer", consumer_main, spec)
    rows = []
    try:
        _, ready = producer.expect(("ready",), START_WAIT_S, "the producer's handshake reply")
        consumer.conn.send(("producer", ready))
        while True:
            kind, value = consumer.expect(("row", "done"), START_WAIT_S + ROW_WAIT_S, "a row")
            if kind == "done":
                num_pulls = value
                break
            value.update(device=device, shape=shape, order=order)
            rows.append(value)
            progress(f"{shape} {order}-major {value['pattern']} {value['tokens']} tokens: {value['gbps']:.2f} GB/s "
                     f"(ceiling {value['ceiling_gbps']:.2f}, {value['descriptors']} descriptors)")  # fmt: skip
        producer.conn.send(("releases", num_pulls))
        _, releases = producer.expect(("releases",), 30.0, "its count of releases")
        if releases != num_pulls:
            raise PdserveError(
                f"{shape}: the producer received {releases} releases for {num_pulls} pulls"
            )
    finally:
        consumer.stop()
        producer.stop()
    return {
        "rows": rows,
        "pulls": num_pulls,
        "releases": releases,
        "cache_blocks": spec["num_blocks"],
    }


def kv_dtype_of(kv_cache_dtype: str) -> str:
    """The stored dtype of the pulled caches: bfloat16 (auto) or float8_e4m3fn (fp8)."""
    return "float8_e4m3fn" if kv_cache_dtype == "fp8" else DTYPE


def check_memory(device: str, shape: str, tokens: list[int], dtype: str = DTYPE) -> None:
    """Refuse a cpu run whose two caches would not fit the memory available now."""
    from pdserve.cli.bench.transfer_cache import cache_blocks, make_layout
    from pdserve.common.errors import PdserveError

    if device != "cpu":
        return
    layout = make_layout(shape, cache_blocks(shape, max(tokens)), dtype=dtype)
    need = 2 * layout.total_bytes
    available = _available_bytes()
    if available is not None and need > 0.8 * available:
        raise PdserveError(
            f"{shape} at {max(tokens)} tokens needs {need / 2**30:.1f} GiB for the two caches, "
            f"{available / 2**30:.1f} GiB are available; choose fewer --tokens"
        )


def _available_bytes() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


# -- output -------------------------------------------------------------------------------

COLUMNS = (
    ("shape", "shape", "{}"), ("order", "order", "{}"), ("pattern", "pattern", "{}"), ("tokens", "tokens", "{:,}"),
    ("bytes", "MiB", "{:,.0f}"), ("descriptors", "desc", "{:,}"), ("nixl_descriptors", "NIXL desc", "{:,}"),
    ("gbps", "pull GB/s", "{:.2f}"), ("ceiling_gbps", "1-desc READ GB/s", "{:.2f}"),
    ("copy_gbps", "copy GB/s", "{:.2f}"), ("ratio", "pull/ceiling", "{:.0%}"),
)  # fmt: skip


def format_table(rows: list[dict[str, Any]]) -> str:
    header = [title for _, title, _ in COLUMNS]
    body = []
    for row in rows:
        cells = []
        for key, _, fmt in COLUMNS:
            value = row[key] / 2**20 if key == "bytes" else row[key]
            cells.append("-" if value is None else fmt.format(value))
        body.append(cells)
    widths = [max(len(line[i]) for line in [header, *body]) for i in range(len(header))]

    def line(cells: list[str]) -> str:
        left = [c.ljust(w) for c, w in zip(cells[:3], widths[:3], strict=True)]
        return "  ".join(left + [c.rjust(w) for c, w in zip(cells[3:], widths[3:], strict=True)])

    return "\n".join([line(header), line(["-" * w for w in widths]), *map(line, body)])


def bench_config(args: argparse.Namespace, load_start: float) -> dict[str, Any]:
    from importlib.metadata import PackageNotFoundError, version

    import torch

    from pdserve.cli.bench.bench_rows import device_name

    try:
        nixl_version = version("nixl")
    except PackageNotFoundError:
        nixl_version = None
    return {
        "device": args.device, "device_name": device_name(args.device), "shapes": args.shape, "orders": args.order,
        "tokens": args.tokens, "fragment": args.fragment, "repeats": args.repeats,
        "num_threads": args.num_threads, "producer_poll_ms": args.producer_poll_ms,
        "block_size": 64, "dtype": kv_dtype_of(args.kv_cache_dtype),
        "ucx_env": {k: v for k, v in os.environ.items() if k.startswith("UCX_")},
        "torch_version": torch.__version__, "nixl_version": nixl_version,
        "cpu_count": os.cpu_count(), "loadavg_1m_start": load_start,
        "loadavg_1m_end": os.getloadavg()[0], "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }  # fmt: skip


def run(args: argparse.Namespace) -> int:
    from pdserve.common.errors import PdserveError

    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise PdserveError("--device cuda: torch sees no CUDA device")
    plans = [(shape, args.tokens or DEFAULT_TOKENS[(args.device, shape)]) for shape in args.shape]
    for shape, tokens in plans:
        check_memory(args.device, shape, tokens, kv_dtype_of(args.kv_cache_dtype))
    load_start = os.getloadavg()[0]
    rows, shapes = [], {}
    for shape, tokens in plans:
        for order in args.order:
            progress(f"{shape} {order}-major on {args.device}: tokens {tokens}, fragment "
                     f"{args.fragment or 'none'}, {args.repeats} repeats")  # fmt: skip
            result = run_shape(args.device, shape, order, tokens, args)
            rows += result.pop("rows")
            shapes[f"{shape}/{order}"] = result
    print(
        f"device {args.device}  repeats {args.repeats}  NIXL UCX threads {args.num_threads or 'default'}"
    )
    print(format_table(rows))
    if args.json is not None:
        config = {**provenance(), **bench_config(args, load_start), "per_shape": shapes}
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(
            json.dumps({"benchmark": "transfer", "config": config, "rows": rows}, indent=2) + "\n"
        )
        progress(f"wrote {args.json}")
    return 0
