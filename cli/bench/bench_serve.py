"""``pdserve bench serve``: load a deployment over HTTP, as ``vllm bench serve`` does.

Against a running deployment, or a self-contained comparison of the disaggregated
deployment (every prompt through the prefill instance) with the colocated baseline
(router + decode only, decode computes prompts) and conditional disaggregation (prompts
whose uncached part is under --local-prefill-threshold, or that the prefill instance is
too far behind on, computed by decode; services/router/local_prefill.py):

    pdserve bench serve --url http://127.0.0.1:8000 --num-prompts 64 --request-rate 4
    pdserve bench serve --compare --num-prompts 32 --max-concurrency 8 \\
        --json benchmarks/results/serve_cpu.json
    pdserve bench serve --compare --modes colocated --max-concurrency 1,8,16 \\
        --peer-url http://127.0.0.1:8011 --peer-label vllm   # cli/bench_peer.py
    pdserve bench serve --compare --request-rate 0.5,1,2 --goodput ttft:2000 tpot:200 \\
        --length-dist lognormal --json benchmarks/results/goodput_cpu.json

Every request is a random prompt of exactly --input-len token ids, sent to
/v1/completions with stream, ignore_eos and max_tokens=--output-len, so every output has
exactly --output-len tokens; with --length-dist lognormal, both lengths are drawn per
request from lognormals of those medians (--input-sigma, --output-sigma, capped at
--max-input-len, --max-output-len), the same draws at every rate. Prompts are seeded and
distinct, so no prefix-cache hits (reported as "cached prompt tokens" and "prefix hit
rate"; run twice against one deployment with a new --seed). --multi-turn N makes them
chats instead: num-prompts / N users, interleaved, each turn sent once its previous
answer is in, its prompt the conversation so far (earlier prompts, seeded stand-ins for
the answers) plus a new message of --input-len tokens (cli/serve_load.py conversations):
the workload a host tier under the prefix cache pays on (--kv-host-cache-gb).

Every server is warmed before its first load is measured (--num-warmups N, default 2; 0
turns it off): N requests per length bucket (powers of two from 16 up to the load's
longest prompt, one at a time) and N bursts per batch size (2, 4, ... up to the largest
--max-concurrency, else up to 64 or --num-prompts, of the median prompt length), so that
every kernel shape the load reaches is compiled outside the measured requests
(cli/serve_load.py warmup_plan); the JSON keeps them (each first run's "warmup": how many,
their lengths, bursts and durations). One more untimed request opens each load. Requests
arrive all at once (--request-rate inf) or as a seeded Poisson process (--burstiness 1;
gamma-distributed gaps otherwise, as vLLM's), at most --max-concurrency in flight. A list
of rates or concurrencies runs one load per value (per pair, with both) on each server.

--goodput ttft:MS tpot:MS e2el:MS (vLLM's): a request is good when it meets every target
given. Per load: the share of requests meeting each target and all of them, and good
requests/s; per mode: the goodput, the highest swept rate with >= 90% of requests good,
interpolated between rates (DistServe's; cli/goodput.py), per device with --num-devices.
Plot it with benchmarks/plot_serve.py (attainment against rate).

Metrics, as vLLM defines them: throughputs over the whole run's duration; TTFT = time to
the first chunk with text; TPOT = (e2e - TTFT) / (output tokens - 1), one per request;
ITL = every gap between chunks with text, all requests pooled; E2E = request latency.
TTFT by part (queue, prefill, handoff, handshake, blocks, pull, first_chunk, return;
common/runtime/ttft.py): mean and median over the load's requests, from the router's /metrics
(cli/ttft_parts.py); they add up to the router's TTFT (locally prefilled requests have
none). The local prefill share: the load's requests the router had prefilled by their
decode instance (``pdserve:local_prefills_total``), "-" where the server has no counter.
Host-tier pull (GB/s): the bytes decode read from a prefill's host tier during the load
over those READs' seconds (``pdserve:kv_host_tier_pull_bytes`` / ``_seconds``; a
disaggregated deployment with --kv-host-cache-gb), "-" where none was read.
--compare deploys with `pdserve up`'s defaults (PDSERVE_* variables apply, e.g.
PDSERVE_ENGINE__KV_CACHE_MEMORY_GB=2) on free local ports; on one GPU its prefill and
decode processes run under CUDA MPS (--gpu-share, cli/gpu_share.py; each deployment's
"mps" in the JSON). The table goes to stdout,
progress to stderr; --json writes the config, the metrics and every request. The load
itself (HTTP requests on their schedule) is cli/serve_http.py's.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from pathlib import Path
from typing import Any

from pdserve.cli.bench import bench_peer, goodput, ttft_parts
from pdserve.cli.bench.arg_types import positive_int, positive_ints  # stdlib-only at import time
from pdserve.cli.bench.serve_http import progress, run_loads
from pdserve.cli.bench.serve_load import STATS, Load, Workload
from pdserve.cli.engine_flags import add_gpu_share, add_kv_cache_dtype
from pdserve.cli.provenance import provenance

LATENCIES = (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2el", "E2E latency"))


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "serve",
        help="online serving load over HTTP (TTFT, TPOT, ITL, throughput)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    target = p.add_mutually_exclusive_group(required=True)
    target.add_argument("--url", help="a running deployment, e.g. http://127.0.0.1:8000")
    target.add_argument(
        "--compare",
        action="store_true",
        help="start disaggregated, then colocated deployments; load each",
    )
    bench_peer.add_flags(p)
    p.add_argument("--model", default=None, help="--compare: HF directory or GGUF file")
    p.add_argument("--device", default=None, choices=("cpu", "cuda"), help="--compare only")
    add_kv_cache_dtype(p)  # --compare only
    add_gpu_share(p)  # --compare only: its prefill and decode on one GPU (cli/gpu_share.py)
    p.add_argument(
        "--local-prefill-threshold",
        type=positive_int,
        default=None,
        metavar="TOKENS",
        help="--compare's conditional mode: prefill on decode below this many uncached "
        "prompt tokens (default: local_prefill_threshold of the config, env or default)",
    )
    p.add_argument("--num-prompts", type=positive_int, default=64)
    p.add_argument(
        "--request-rate",
        type=_rates,
        default=[math.inf],
        help="requests/s, Poisson arrivals (seeded); inf: all at once; a list, e.g. "
        "0.5,1,2, runs one load per rate against each deployment (a goodput sweep)",
    )
    p.add_argument(
        "--burstiness",
        type=_positive_float,
        default=1.0,
        help="the shape of the gamma-distributed gaps between arrivals (mean 1 / rate): "
        "1 is Poisson, below 1 burstier, above 1 more even (vLLM's flag)",
    )
    p.add_argument(
        "--goodput",
        nargs="+",
        type=goodput.slo_item,
        default=None,
        metavar="NAME:MS",
        help="SLO targets in ms (ttft, tpot, e2el), e.g. ttft:500 tpot:50: report each "
        "load's attainment and each mode's goodput (cli/goodput.py)",
    )
    p.add_argument(
        "--num-devices",
        type=positive_int,
        default=None,
        help="the devices a deployment uses, for goodput per device (default: 1 with "
        "--compare, whose processes share one device; unknown with --url)",
    )
    p.add_argument(
        "--max-concurrency",
        type=positive_ints,
        default=None,
        help="at most this many requests in flight (default: no limit); a list, "
        "e.g. 1,8,32, runs one load per value against each deployment",
    )
    p.add_argument(
        "--hf-reference",
        action="store_true",
        help="--compare: also time Hugging Face generate() on the same model and "
        "prompts, batches of each --max-concurrency (cli/bench_serve_hf.py)",
    )
    p.add_argument("--input-len", type=positive_int, default=256,
                   help="prompt tokens (lognormal: the median)")  # fmt: skip
    p.add_argument("--output-len", type=positive_int, default=64,
                   help="generated tokens (lognormal: the median)")  # fmt: skip
    p.add_argument(
        "--length-dist",
        choices=("fixed", "lognormal"),
        default="fixed",
        help="fixed: every request --input-len / --output-len; lognormal: each length "
        "drawn per request (seeded), a long tail as chat traffic has",
    )
    for side in ("input", "output"):
        p.add_argument(f"--{side}-sigma", type=_positive_float, default=1.0,
                       help=f"lognormal: sigma of ln({side} tokens) (1.0: the 90th "
                       "percentile 3.6x the median)")  # fmt: skip
        p.add_argument(f"--max-{side}-len", type=positive_int, default=None,
                       help=f"lognormal: cap of {side} tokens (default 8x the median)")  # fmt: skip
    p.add_argument(
        "--multi-turn",
        type=positive_int,
        default=1,
        metavar="N",
        help="conversations of N turns: num-prompts / N users interleaved, each turn sent "
        "once its previous answer is in, its prompt the history (earlier prompts and "
        "stand-ins for the answers) plus a new message of --input-len tokens; seeded",
    )
    p.add_argument(
        "--num-warmups",
        type=int,
        default=2,
        metavar="N",
        help="before measuring a server: N requests per length bucket (powers of two up "
        "to the longest prompt) and N bursts per batch size (2, 4, ... up to the "
        "concurrency), untimed, recorded in the JSON; 0: none (vLLM's --num-warmups)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of prompts and arrivals")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--label", default=None, help="a name for this run, kept in the JSON")
    p.add_argument(
        "--json",
        type=Path,
        default=None,
        metavar="FILE",
        help="also write config, metrics and per-request records here",
    )
    p.set_defaults(run=run)


def _rates(text: str) -> list[float]:
    """Comma-separated requests/s, each positive or inf; swept in the order given."""
    try:
        values = [float(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected rates like 0.5,1,inf, got {text!r}") from None
    if not values or not all(v > 0 for v in values):
        raise argparse.ArgumentTypeError(f"every rate must be positive or inf, got {text!r}")
    return values


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0 or math.isinf(value):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


def workload_of(args: argparse.Namespace) -> Workload:
    return Workload(dist=args.length_dist, input_len=args.input_len, output_len=args.output_len,
                    input_sigma=args.input_sigma, output_sigma=args.output_sigma,
                    max_input_len=args.max_input_len, max_output_len=args.max_output_len,
                    turns=args.multi_turn)  # fmt: skip


def loads_of(args: argparse.Namespace) -> list[Load]:
    """Each concurrency cap, and under it each rate in the order given."""
    return [Load(rate, c) for c in args.max_concurrency or [None] for rate in args.request_rate]


# -- deployments (--compare) ------------------------------------------------------------


def run_deployed(args: argparse.Namespace, label: str,
                 loads: list[Load]) -> list[dict[str, Any]]:  # fmt: skip
    """Start the deployment of mode ``label`` (bench_peer.MODES), run every load on it."""
    from pdserve.cli.deployment import Deployment, local_config
    from pdserve.common.errors import PdserveError
    from pdserve.common.runtime.ports import free_port_block

    base = free_port_block(100)
    # disaggregated: every prompt through the prefill instance; conditional: the threshold
    # given, else the configured one (env, default)
    threshold = {"disaggregated": 0, "colocated": 0}.get(label, args.local_prefill_threshold)
    cfg = local_config(model=args.model, device=args.device, colocated=label == "colocated",
                       base_port=base, http_port=base + 99, local_prefill_threshold=threshold,
                       engine=None if args.kv_cache_dtype is None else {"kv_cache_dtype": args.kv_cache_dtype})  # fmt: skip
    if label == "conditional" and cfg.local_prefill_threshold == 0:
        raise PdserveError("the conditional mode needs a local_prefill_threshold above 0 (it "
                           "is 0 in the environment or config); give --local-prefill-threshold")  # fmt: skip
    dep = Deployment(cfg, gpu_share=args.gpu_share)
    progress(f"{label}: starting {', '.join(n for n, _ in dep.roles())} (logs in {dep.log_dir})")
    with dep:
        mps = None if dep.mps is None else {"started": dep.mps.started,
                                            "pipe_dir": str(dep.mps.pipe_dir),
                                            "role_env": dep.role_env}  # fmt: skip
        results = run_loads(dep.url, args, loads, label)
    for result in results:
        result["deployment"] = {
            "colocated": cfg.colocated, "device": cfg.device, "model": cfg.model,
            "local_prefill_threshold": cfg.local_prefill_threshold,
            "roles": [name for name, _ in dep.roles()], "torch_threads": cfg.torch_threads,
            "prefill_torch_threads": cfg.prefill_torch_threads,
            "decode_torch_threads": cfg.decode_torch_threads,
            "log_dir": str(dep.log_dir),
            "gpu_share": args.gpu_share.mode, "mps": mps,
        }  # fmt: skip
    return results


# -- output -----------------------------------------------------------------------------


def table_rows() -> list[tuple[str, str, str]]:
    rows = [("completed", "completed", "{:d}"), ("failed", "failed", "{:d}"),
            ("duration_s", "duration (s)", "{:.2f}"),
            ("request_throughput", "request throughput (req/s)", "{:.3f}"),
            ("output_throughput", "output token throughput (tok/s)", "{:.1f}"),
            ("total_token_throughput", "total token throughput (tok/s)", "{:.1f}"),
            ("cached_prompt_tokens", "cached prompt tokens", "{:d}"),
            ("prefix_hit_rate", "prefix hit rate", "{:.1%}"),
            ("local_prefill_share", "local prefill share", "{:.0%}"),
            ("tier_pull_gbps", "host-tier pull (GB/s)", "{:.2f}")]  # fmt: skip
    for name, title in LATENCIES:
        rows += [(f"{stat}_{name}_ms", f"{title} {stat} (ms)", "{:.1f}") for stat in STATS]
    return rows


def format_table(runs: list[dict[str, Any]]) -> str:
    header = ["metric", *(run["label"] for run in runs)]
    body = [[title, *(fmt.format(v) if (v := run["metrics"].get(key)) is not None else "-"
                      for run in runs)]
            for key, title, fmt in table_rows()]  # fmt: skip
    body += ttft_parts.table_rows(runs)
    widths = [max(len(line[i]) for line in [header, *body]) for i in range(len(header))]

    def line(cells: list[str]) -> str:
        first, *rest = cells
        return "  ".join(
            [first.ljust(widths[0]), *(c.rjust(w) for c, w in zip(rest, widths[1:], strict=True))]
        )

    return "\n".join([line(header), line(["-" * w for w in widths]), *map(line, body)])


def bench_config(args: argparse.Namespace) -> dict[str, Any]:
    return {
        **provenance(),
        "label": args.label, "mode": "compare" if args.compare else "url", "url": args.url,
        "model": args.model, "device": args.device, "num_prompts": args.num_prompts,
        "kv_cache_dtype": args.kv_cache_dtype, "peer_url": args.peer_url,
        "gpu_share": args.gpu_share.describe() if args.gpu_share.mode != "off" else "off",
        "local_prefill_threshold": args.local_prefill_threshold,
        "modes": args.modes if args.compare else None,
        "request_rate": ["inf" if math.isinf(r) else r for r in args.request_rate],  # no inf in JSON
        "burstiness": args.burstiness, "goodput_slos_ms": args.slos or None,
        "max_concurrency": args.max_concurrency, "hf_reference": args.hf_reference,
        "input_len": args.input_len, "output_len": args.output_len,
        "length_dist": args.length_dist, "multi_turn": args.multi_turn,
        **({} if args.length_dist == "fixed" else {
            "input_sigma": args.input_sigma, "output_sigma": args.output_sigma,
            "max_input_len": args.workload.input_cap, "max_output_len": args.workload.output_cap}),
        "seed": args.seed, "timeout_s": args.timeout, "num_warmups": args.num_warmups,
        "cpu_count": os.cpu_count(), "loadavg_1m": os.getloadavg()[0],
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }  # fmt: skip


def write_json(path: Path, config: dict[str, Any], runs: list[dict[str, Any]],
               goodputs: list[dict[str, Any]] | None) -> None:  # fmt: skip
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {"benchmark": "serve", "config": config, "runs": runs}
    if goodputs is not None:
        payload["goodput"] = {"target": goodput.TARGET, "slos_ms": config["goodput_slos_ms"],
                              "series": goodputs}  # fmt: skip
    path.write_text(json.dumps(payload, indent=2) + "\n")


def score(args: argparse.Namespace, runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each run's SLO attainment (not the HF reference's: it has no per-token times),
    then each mode's goodput."""
    for run_ in runs:
        if "requests" in run_:
            run_["goodput"] = goodput.attainment(run_["requests"], args.slos,
                                                 run_["metrics"]["duration_s"])  # fmt: skip
    devices = args.num_devices or (1 if args.compare else None)
    return goodput.series(runs, devices)


# -- the command ------------------------------------------------------------------------


def check(args: argparse.Namespace) -> None:
    """Flags that parse but do not go together, refused before any deployment starts."""
    from pdserve.common.errors import PdserveError

    if args.url and (args.model or args.device):
        raise PdserveError("--model and --device choose what --compare deploys; with --url "
                           "the deployment is already running")  # fmt: skip
    if args.hf_reference and not args.compare:
        raise PdserveError("--hf-reference needs --compare: it loads the model --compare deploys")
    if args.hf_reference and (args.length_dist != "fixed" or len(args.request_rate) > 1):
        raise PdserveError("--hf-reference batches fixed-length prompts by concurrency; it "
                           "takes neither --length-dist lognormal nor a list of rates")  # fmt: skip
    if args.num_warmups < 0:
        raise PdserveError(f"--num-warmups must be 0 or more, got {args.num_warmups}")
    try:
        args.slos = goodput.slos_of(args.goodput)
    except argparse.ArgumentTypeError as exc:
        raise PdserveError(str(exc)) from None
    args.workload = workload_of(args)


def run(args: argparse.Namespace) -> int:
    from pdserve.common.errors import PdserveError

    check(args)
    config = bench_config(args)
    loads = loads_of(args)
    try:
        if args.compare:
            runs = [run for mode in args.modes for run in run_deployed(args, mode, loads)]
            if args.hf_reference:
                from pdserve.cli.bench.bench_serve_hf import hf_runs

                concurrencies = list(args.max_concurrency or [None])
                runs += hf_runs(args, concurrencies, tuple(runs[0]["server"]["token_id_range"]),
                                progress)  # fmt: skip
        else:
            runs = run_loads(args.url, args, loads, args.label or "serve")
        if args.peer_url:
            runs += bench_peer.peer_runs(args, loads, tuple(runs[0]["server"]["token_id_range"]))
    except RuntimeError as exc:  # a server that is unreachable or refuses the warm-up
        raise PdserveError(str(exc)) from exc
    goodputs = score(args, runs) if args.slos else None
    server = runs[0]["server"]
    lengths = ("" if args.length_dist == "fixed" else
               f" (lognormal medians, sigma {args.input_sigma:g} / {args.output_sigma:g}, caps "
               f"{args.workload.input_cap} / {args.workload.output_cap})")  # fmt: skip
    print(
        f"model {server['model']}  prompts {args.num_prompts}  input {args.input_len}  "
        f"output {args.output_len}{lengths}  rate {','.join(map(str, config['request_rate']))}"
        f"{'' if args.burstiness == 1 else f' burstiness {args.burstiness:g}'}  concurrency "
        f"{','.join(map(str, args.max_concurrency or [])) or 'unlimited'}  seed {args.seed}"
    )
    print(format_table(runs))
    if goodputs is not None:
        print()
        print(goodput.format_tables(goodputs, args.slos))
    if args.json is not None:
        write_json(args.json, config, runs, goodputs)
        progress(f"wrote {args.json}")
    return 0 if all(r["metrics"]["failed"] == 0 for r in runs) else 1
