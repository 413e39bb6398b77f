"""``pdserve bench <benchmark>``: the benchmarks, one module each.

This module only wires the parsers: each benchmark module exposes ``add_parser(sub)``,
which adds its own sub-subcommand and sets ``run=``. To add one, write
``cli/bench/bench_<name>.py`` and list it in ``BENCHMARKS``.
"""

from __future__ import annotations

import argparse
from typing import Any

from pdserve.cli.bench import bench_accuracy, bench_engine, bench_serve, bench_transfer

# Only the parser set-up runs at import time; heavy imports (torch, transformers) stay
# inside each module's run(), so `pdserve --help` stays fast.
BENCHMARKS = (bench_engine, bench_serve, bench_transfer, bench_accuracy)


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "bench",
        help="benchmarks (engine vs Hugging Face, serving over HTTP, KV transfer)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    benches = p.add_subparsers(dest="benchmark", required=True, metavar="BENCHMARK")
    for module in BENCHMARKS:
        module.add_parser(benches)
