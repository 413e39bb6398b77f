"""``pdserve bench serve``: load a deployment over HTTP, as ``vllm bench serve`` does.

Against a running deployment, or a self-contained comparison of the disaggregated
deployment with the colocated baseline (router + decode only, decode computes prompts):

    pdserve bench serve --url http://127.0.0.1:8000 --num-prompts 64 --request-rate 4
    pdserve bench serve --compare --num-prompts 32 --max-concurrency 8 \\
        --json benchmarks/results/serve_cpu.json
    pdserve bench serve --compare --modes colocated --max-concurrency 1,8,16 \\
        --peer-url http://127.0.0.1:8011 --peer-label vllm   # cli/bench_peer.py

Every request is a random prompt of exactly --input-len token ids, sent to
/v1/completions with stream, ignore_eos and max_tokens=--output-len, so every output has
exactly --output-len tokens. Prompts are seeded and distinct, so no prefix-cache hits
(reported as "cached prompt tokens"; run twice against one deployment with a new --seed).
One untimed warm-up request goes first. Requests arrive all at once (--request-rate inf)
or as a seeded Poisson process, at most --max-concurrency in flight.

Metrics, as vLLM defines them: throughputs over the whole run's duration; TTFT = time to
the first chunk with text; TPOT = (e2e - TTFT) / (output tokens - 1), one per request;
ITL = every gap between chunks with text, all requests pooled; E2E = request latency.
TTFT by part (queue, prefill, handoff, handshake, blocks, pull, first_chunk, return;
common/runtime/ttft.py): mean and median over the load's requests, from the router's /metrics
(cli/ttft_parts.py); they add up to the router's TTFT.
--compare deploys with `pdserve up`'s defaults (PDSERVE_* variables apply, e.g.
PDSERVE_ENGINE__KV_CACHE_MEMORY_GB=2) on free local ports. The table goes to stdout,
progress to stderr; --json writes the config, the metrics and every request.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pdserve.cli import bench_peer, ttft_parts
from pdserve.cli.arg_types import positive_int, positive_ints  # stdlib-only at import time
from pdserve.cli.engine_flags import add_kv_cache_dtype
from pdserve.cli.provenance import provenance
from pdserve.cli.serve_load import (
    STATS,
    RequestRecord,
    arrival_offsets,
    compute_metrics,
    make_prompts,
)

if TYPE_CHECKING:
    import aiohttp

FALLBACK_TOKEN_IDS = (1000, 30000)  # when the server does not say its vocabulary
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
    p.add_argument("--num-prompts", type=positive_int, default=64)
    p.add_argument(
        "--request-rate",
        type=_rate,
        default=math.inf,
        help="requests/s, Poisson arrivals (seeded); inf: all at once",
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
    p.add_argument("--input-len", type=positive_int, default=256, help="prompt tokens")
    p.add_argument("--output-len", type=positive_int, default=64, help="generated tokens")
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


def _for_load(args: argparse.Namespace, index: int, load: int | None) -> argparse.Namespace:
    """The arguments of one load: its concurrency, and its own prompts (seed + index), so
    that a later load on the same deployment gets no prefix-cache hits from an earlier."""
    return argparse.Namespace(**{**vars(args), "max_concurrency": load, "seed": args.seed + index})


def _rate(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be positive or inf, got {text}")
    return value


def progress(message: str) -> None:
    print(f"bench serve: {message}", file=sys.stderr, flush=True)


# -- the load (HTTP) --------------------------------------------------------------------


class Progress:
    """A bar on stderr: one redrawn line on a terminal, else a line per 10% (readable logs)."""

    def __init__(self, total: int, label: str) -> None:
        self.total, self.label, self.done = total, label, 0
        self.started, self.tty = time.perf_counter(), sys.stderr.isatty()

    def update(self) -> None:
        self.done += 1
        if not self.tty and self.done % max(1, self.total // 10) and self.done != self.total:
            return
        filled = 30 * self.done // self.total
        line = (
            f"bench serve: {self.label} [{'#' * filled}{'.' * (30 - filled)}] "
            f"{self.done}/{self.total} {time.perf_counter() - self.started:.1f} s"
        )
        end = "\n" if not self.tty or self.done == self.total else ""
        print(f"\r{line}" if self.tty else line, end=end, file=sys.stderr, flush=True)


async def _http_error(resp: aiohttp.ClientResponse) -> str:
    text = await resp.text()
    try:
        return f"HTTP {resp.status}: {json.loads(text)['error']['message']}"
    except (ValueError, KeyError, TypeError):
        return f"HTTP {resp.status}: {text[:200]}"


async def send_request(session: aiohttp.ClientSession, url: str, prompt: list[int],
                       output_len: int, record: RequestRecord,
                       model: str | None = None) -> None:  # fmt: skip
    """One streamed completion; fills ``record`` and never raises (but for cancellation)."""
    body: dict[str, Any] = {} if model is None else {"model": model}
    body |= {
        "prompt": prompt,
        "max_tokens": output_len,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    record.prompt_tokens = len(prompt)
    start = last = time.perf_counter()
    chunks, usage = 0, None
    try:
        async with session.post(f"{url}/v1/completions", json=body) as resp:
            if resp.status != 200:
                record.error = await _http_error(resp)
                return
            async for raw in resp.content:
                line = raw.decode().strip()
                if not line.startswith("data:"):
                    continue  # the blank line that ends each event
                data = line[len("data:") :].strip()
                if data == "[DONE]":
                    break
                event = json.loads(data)
                if "error" in event:  # a failure after the stream started
                    record.error = f"stream error: {event['error'].get('message')}"
                    return
                usage = event.get("usage") or usage
                if any(c.get("text") for c in event.get("choices") or ()):
                    now = time.perf_counter()
                    if chunks == 0:
                        record.ttft_s = now - start
                    else:
                        record.itl_s.append(now - last)
                    chunks, last = chunks + 1, now
        record.e2e_s = time.perf_counter() - start
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # noqa: BLE001 - a failed request is a record, not the end
        record.error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        return
    if chunks == 0:
        record.error = "the stream carried no text"
        return
    record.output_tokens = usage["completion_tokens"] if usage else chunks
    details = (usage or {}).get("prompt_tokens_details") or {}
    record.cached_tokens = details.get("cached_tokens", 0)
    record.ok = True


async def server_info(session: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    """The served model, its length and the token-id range of the random prompts."""
    async with session.get(f"{url}/v1/models") as resp:
        if resp.status != 200:
            raise RuntimeError(f"GET {url}/v1/models: {await _http_error(resp)}")
        card = (await resp.json())["data"][0]
    vocab = card.get("vocab_size")
    if vocab is None:  # the router's /openapi.json bounds prompt token ids by the vocabulary
        with contextlib.suppress(Exception):
            async with session.get(f"{url}/openapi.json") as resp:
                vocab = _vocab_from_openapi(await resp.json())
    id_range = (0, vocab) if vocab else FALLBACK_TOKEN_IDS
    return {"model": card["id"], "max_model_len": card.get("max_model_len"),
            "vocab_size": vocab, "token_id_range": list(id_range)}  # fmt: skip


def _vocab_from_openapi(document: dict[str, Any]) -> int | None:
    prompt = document["components"]["schemas"]["CompletionRequest"]["properties"]["prompt"]
    for shape in prompt.get("anyOf", ()):
        items = shape.get("items", {})
        if shape.get("type") == "array" and items.get("type") == "integer":
            maximum = items.get("maximum")
            return None if maximum is None else int(maximum) + 1
    return None


async def run_load(url: str, args: argparse.Namespace, label: str) -> dict[str, Any]:
    """Warm up, send every request on its schedule, and return the run's results."""
    import aiohttp

    url = url.rstrip("/")
    timeout = aiohttp.ClientTimeout(total=args.timeout, sock_connect=30)
    # No connection cap of aiohttp's own: concurrency is what the flags say, no less.
    async with aiohttp.ClientSession(
        timeout=timeout, connector=aiohttp.TCPConnector(limit=0)
    ) as session:
        try:
            info = await server_info(session, url)
        except aiohttp.ClientError as exc:
            raise RuntimeError(f"cannot reach {url}: {exc}") from exc
        limit = info["max_model_len"]
        if limit is not None and args.input_len + args.output_len > limit:
            raise RuntimeError(f"--input-len + --output-len exceeds max_model_len {limit}")
        # a peer (cli/bench_peer.py) takes pdserve's ids and is told the model's name
        id_range = tuple(getattr(args, "token_id_range", None) or info["token_id_range"])
        model = info["model"] if getattr(args, "name_model", False) else None
        info["token_id_range"] = list(id_range)
        prompts = make_prompts(args.num_prompts, args.input_len, id_range, args.seed)
        # The first request pays one-off costs (allocation, lazy init): keep it out.
        warm = RequestRecord(-1)
        [warm_prompt] = make_prompts(1, args.input_len, id_range, args.seed, "warm-up")
        await send_request(session, url, warm_prompt, args.output_len, warm, model)
        if not warm.ok:
            raise RuntimeError(f"the warm-up request to {url} failed: {warm.error}")
        parts_before = await ttft_parts.scrape(session, url)

        records = [RequestRecord(i) for i in range(args.num_prompts)]
        gate = (asyncio.Semaphore(args.max_concurrency) if args.max_concurrency
                else contextlib.nullcontext())  # fmt: skip
        bar = Progress(args.num_prompts, label)
        load_start = os.getloadavg()[0]
        start = time.perf_counter()

        async def one(record: RequestRecord) -> None:
            async with gate:
                record.start_s = time.perf_counter() - start
                await send_request(session, url, prompts[record.index], args.output_len,
                                   record, model)  # fmt: skip
            bar.update()

        tasks = []
        for record, offset in zip(records, arrival_offsets(len(records), args.request_rate,
                                                           args.seed), strict=True):  # fmt: skip
            await asyncio.sleep(max(0.0, start + offset - time.perf_counter()))
            tasks.append(asyncio.create_task(one(record)))
        await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        parts_after = await ttft_parts.scrape(session, url)
    metrics = compute_metrics(records, duration)
    metrics.update(ttft_parts.part_metrics(parts_before, parts_after))
    for record in records:
        if record.error:
            progress(f"{label}: request {record.index} failed: {record.error}")
    return {"label": label, "url": url, "server": info, "loadavg_1m_start": load_start,
            "loadavg_1m_end": os.getloadavg()[0], "metrics": metrics,
            "requests": [r.public() for r in records]}  # fmt: skip


# -- deployments (--compare) ------------------------------------------------------------


def run_deployed(args: argparse.Namespace, label: str, colocated: bool,
                 loads: list[int | None]) -> list[dict[str, Any]]:  # fmt: skip
    from pdserve.cli.deployment import Deployment, local_config
    from pdserve.common.runtime.ports import free_port_block

    base = free_port_block(100)
    cfg = local_config(model=args.model, device=args.device, colocated=colocated,
                       base_port=base, http_port=base + 99,
                       engine=None if args.kv_cache_dtype is None else {"kv_cache_dtype": args.kv_cache_dtype})  # fmt: skip
    dep = Deployment(cfg)
    progress(f"{label}: starting {', '.join(n for n, _ in dep.roles())} (logs in {dep.log_dir})")
    results = []
    with dep:
        for index, load in enumerate(loads):
            name = label if len(loads) == 1 else f"{label} c={load or 'inf'}"
            results.append(asyncio.run(run_load(dep.url, _for_load(args, index, load), name)))
            results[-1].update(load=load, mode=label)
    for result in results:
        result["deployment"] = {
            "colocated": cfg.colocated, "device": cfg.device, "model": cfg.model,
            "roles": [name for name, _ in dep.roles()], "torch_threads": cfg.torch_threads,
            "prefill_torch_threads": cfg.prefill_torch_threads,
            "decode_torch_threads": cfg.decode_torch_threads,
            "log_dir": str(dep.log_dir),
        }  # fmt: skip
    return results


# -- output -----------------------------------------------------------------------------


def table_rows() -> list[tuple[str, str, str]]:
    rows = [("completed", "completed", "{:d}"), ("failed", "failed", "{:d}"),
            ("duration_s", "duration (s)", "{:.2f}"),
            ("request_throughput", "request throughput (req/s)", "{:.3f}"),
            ("output_throughput", "output token throughput (tok/s)", "{:.1f}"),
            ("total_token_throughput", "total token throughput (tok/s)", "{:.1f}"),
            ("cached_prompt_tokens", "cached prompt tokens", "{:d}")]  # fmt: skip
    for name, title in LATENCIES:
        rows += [(f"{stat}_{name}_ms", f"{title} {stat} (ms)", "{:.1f}") for stat in STATS]
    return rows


def format_table(runs: list[dict[str, Any]]) -> str:
    header = ["metric", *(run["label"] for run in runs)]
    body = [[title, *(fmt.format(v) if (v := run["metrics"][key]) is not None else "-"
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
    rate = args.request_rate
    return {
        **provenance(),
        "label": args.label, "mode": "compare" if args.compare else "url", "url": args.url,
        "model": args.model, "device": args.device, "num_prompts": args.num_prompts,
        "kv_cache_dtype": args.kv_cache_dtype, "peer_url": args.peer_url,
        "modes": args.modes if args.compare else None,
        "request_rate": "inf" if math.isinf(rate) else rate,  # JSON has no infinity
        "max_concurrency": args.max_concurrency, "hf_reference": args.hf_reference, "input_len": args.input_len,
        "output_len": args.output_len, "seed": args.seed, "timeout_s": args.timeout,
        "cpu_count": os.cpu_count(), "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }  # fmt: skip


def write_json(path: Path, config: dict[str, Any], runs: list[dict[str, Any]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {"benchmark": "serve", "config": config, "runs": runs}
    path.write_text(json.dumps(payload, indent=2) + "\n")


# -- the command ------------------------------------------------------------------------


def run(args: argparse.Namespace) -> int:
    from pdserve.common.errors import PdserveError

    if args.url and (args.model or args.device):
        raise PdserveError("--model and --device choose what --compare deploys; with --url "
                           "the deployment is already running")  # fmt: skip
    if args.hf_reference and not args.compare:
        raise PdserveError("--hf-reference needs --compare: it loads the model --compare deploys")
    config = bench_config(args)
    loads: list[int | None] = list(args.max_concurrency or [None])
    try:
        if args.compare:
            runs = [run for mode in args.modes
                    for run in run_deployed(args, mode, mode == "colocated", loads)]  # fmt: skip
            if args.hf_reference:
                from pdserve.cli.bench_serve_hf import hf_runs

                runs += hf_runs(args, loads, tuple(runs[0]["server"]["token_id_range"]), progress)
        else:
            label = args.label or "serve"
            runs = [asyncio.run(run_load(args.url, _for_load(args, i, load),
                                         label if len(loads) == 1 else f"{label} c={load}"))
                    for i, load in enumerate(loads)]  # fmt: skip
            for run_, load in zip(runs, loads, strict=True):  # one series in the plot
                run_.update(load=load, mode=label)
        if args.peer_url:
            runs += bench_peer.peer_runs(args, loads, tuple(runs[0]["server"]["token_id_range"]),
                                         run_load, _for_load)  # fmt: skip
    except RuntimeError as exc:  # a server that is unreachable or refuses the warm-up
        raise PdserveError(str(exc)) from exc
    server = runs[0]["server"]
    print(
        f"model {server['model']}  prompts {args.num_prompts}  input {args.input_len}  "
        f"output {args.output_len}  rate {config['request_rate']}  "
        f"concurrency {','.join(map(str, args.max_concurrency or [])) or 'unlimited'}  seed {args.seed}"
    )
    print(format_table(runs))
    if args.json is not None:
        write_json(args.json, config, runs)
        progress(f"wrote {args.json}")
    return 0 if all(r["metrics"]["failed"] == 0 for r in runs) else 1
