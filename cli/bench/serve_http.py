"""The HTTP side of ``pdserve bench serve`` (cli/bench_serve.py): the server's facts
(model, max_model_len, vocabulary), one streamed /v1/completions request recorded as
vLLM's serving metrics need it, a whole load on its arrival schedule at most
--max-concurrency in flight, and a sweep of loads against one server (the pure parts in
cli/serve_load.py).
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
from typing import TYPE_CHECKING, Any

from pdserve.cli.bench import ttft_parts
from pdserve.cli.bench.serve_load import (
    WARMUP_MAX_BURST,
    Load,
    RequestRecord,
    Workload,
    arrival_offsets,
    compute_metrics,
    conversations,
    make_prompts,
    prompt_lengths,
    prompts_of_lengths,
    warmup_plan,
)

if TYPE_CHECKING:
    import aiohttp

FALLBACK_TOKEN_IDS = (1000, 30000)  # when the server does not say its vocabulary


def progress(message: str) -> None:
    print(f"bench serve: {message}", file=sys.stderr, flush=True)


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
        workload: Workload = args.workload
        # lengths and arrivals from the sweep's seed (the same at every rate); the prompts'
        # ids from the load's own (no prefix-cache hits from an earlier load)
        base_seed = getattr(args, "base_seed", args.seed)
        lengths = workload.lengths(args.num_prompts, base_seed)
        # a peer (cli/bench_peer.py) takes pdserve's ids and is told the model's name
        id_range = tuple(getattr(args, "token_id_range", None) or info["token_id_range"])
        if workload.turns > 1:  # each turn carries its conversation's history
            prompts, after = conversations(lengths, workload.turns, id_range, args.seed)
        else:
            prompts = prompts_of_lengths([i for i, _ in lengths], id_range, args.seed)
            after = [None] * len(prompts)
        limit = info["max_model_len"]
        longest = max(len(prompt) + o for prompt, (_, o) in zip(prompts, lengths, strict=True))
        if limit is not None and longest > limit:
            raise RuntimeError(
                f"a request of {longest} tokens (prompt + output) exceeds {url}'s "
                f"max_model_len {limit}; lower --input-len/--output-len"
                + ("" if workload.dist == "fixed" else " or --max-input-len/--max-output-len")
                + ("" if workload.turns == 1 else " or --multi-turn")
            )
        model = info["model"] if getattr(args, "name_model", False) else None
        info["token_id_range"] = list(id_range)
        # The first request pays one-off costs (allocation, lazy init): keep it out.
        warm = RequestRecord(-1)
        [warm_prompt] = make_prompts(1, workload.input_len, id_range, args.seed, "warm-up")
        await send_request(session, url, warm_prompt, workload.output_len, warm, model)
        if not warm.ok:
            raise RuntimeError(f"the warm-up request to {url} failed: {warm.error}")
        before = await ttft_parts.scrape_text(session, url)

        records = [RequestRecord(i) for i in range(args.num_prompts)]
        gate = (asyncio.Semaphore(args.max_concurrency) if args.max_concurrency
                else contextlib.nullcontext())  # fmt: skip
        bar = Progress(args.num_prompts, label)
        load_start = os.getloadavg()[0]
        start = time.perf_counter()

        answered = [asyncio.Event() for _ in records]

        async def one(record: RequestRecord) -> None:
            prev = after[record.index]
            if prev is not None:  # a conversation's next turn follows its previous answer
                await answered[prev].wait()
            async with gate:
                record.start_s = time.perf_counter() - start
                await send_request(session, url, prompts[record.index],
                                   lengths[record.index][1], record, model)  # fmt: skip
            answered[record.index].set()
            bar.update()

        tasks = []
        offsets = arrival_offsets(len(records), args.request_rate, base_seed, args.burstiness)
        for record, offset in zip(records, offsets, strict=True):
            await asyncio.sleep(max(0.0, start + offset - time.perf_counter()))
            tasks.append(asyncio.create_task(one(record)))
        await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        after = await ttft_parts.scrape_text(session, url)
    metrics = compute_metrics(records, duration)
    metrics.update(ttft_parts.part_metrics(ttft_parts.parse(before), ttft_parts.parse(after)))
    # the warm-up went before the first scrape: only the load's requests count
    metrics["local_prefill_share"] = ttft_parts.local_share(before, after, len(records))
    metrics.update(ttft_parts.tier_pull(before, after))
    for record in records:
        if record.error:
            progress(f"{label}: request {record.index} failed: {record.error}")
    return {"label": label, "url": url, "server": info, "loadavg_1m_start": load_start,
            "loadavg_1m_end": os.getloadavg()[0], "metrics": metrics,
            "requests": [r.public() for r in records]}  # fmt: skip


async def warm_up(url: str, args: argparse.Namespace, loads: list[Load],
                  label: str) -> dict[str, Any]:  # fmt: skip
    """Warm the server before any load is measured (``warmup_plan``: every length bucket
    and batch size the loads reach, ``--num-warmups`` of each), and return the record the
    JSON keeps: how many, their lengths, bursts and durations. Failed warm-up requests are
    recorded; if every one failed the server cannot be measured (RuntimeError)."""
    import aiohttp

    url = url.rstrip("/")
    workload: Workload = args.workload
    lengths = workload.lengths(args.num_prompts, args.seed)
    caps = [load.concurrency for load in loads]
    max_burst = (max(c for c in caps if c is not None) if None not in caps
                 else min(args.num_prompts, WARMUP_MAX_BURST))  # fmt: skip
    if workload.turns > 1:  # conversations: at most one turn of each user in flight
        max_burst = min(max_burst, -(-args.num_prompts // workload.turns))
    plan = warmup_plan(args.num_warmups, prompt_lengths(lengths, workload.turns),
                       workload.output_len, max_burst)  # fmt: skip
    timeout = aiohttp.ClientTimeout(total=args.timeout, sock_connect=30)
    records: list[dict[str, Any]] = []
    start = time.perf_counter()
    async with aiohttp.ClientSession(
        timeout=timeout, connector=aiohttp.TCPConnector(limit=0)
    ) as session:
        try:
            info = await server_info(session, url)
        except aiohttp.ClientError as exc:
            raise RuntimeError(f"cannot reach {url}: {exc}") from exc
        id_range = tuple(getattr(args, "token_id_range", None) or info["token_id_range"])
        model = info["model"] if getattr(args, "name_model", False) else None
        limit = info["max_model_len"]
        for phase, requests in enumerate(plan):
            if limit is not None:  # the load's own check names a request that cannot fit
                requests = [(min(i, max(1, limit - o)), o) for i, o in requests]
            prompts = prompts_of_lengths([i for i, _ in requests], id_range,
                                         args.seed + 7919 * (phase + 1), "warm-up")  # fmt: skip
            batch = [RequestRecord(len(records) + k) for k in range(len(requests))]
            sent = time.perf_counter()
            await asyncio.gather(*(send_request(session, url, prompt, o, record, model)
                                   for prompt, (_, o), record in zip(prompts, requests, batch,
                                                                     strict=True)))  # fmt: skip
            for record in batch:
                records.append({"phase": phase, "burst": len(requests),
                                "sent_ms": (sent - start) * 1e3, **record.public()})  # fmt: skip
    duration = time.perf_counter() - start
    failed = sum(not r["ok"] for r in records)
    if records and failed == len(records):
        raise RuntimeError(f"every warm-up request to {url} failed: {records[0]['error']}")
    progress(f"{label}: warmed up with {len(records)} requests in {len(plan)} phases, "
             f"{duration:.1f} s" + (f", {failed} failed" if failed else ""))  # fmt: skip
    return {"num_warmups": args.num_warmups, "num_requests": len(records),
            "num_failed": failed, "duration_s": duration,
            "prompt_lens": sorted({r["prompt_tokens"] for r in records}),
            "bursts": sorted({r["burst"] for r in records}), "requests": records}  # fmt: skip


def for_load(args: argparse.Namespace, index: int, load: Load) -> argparse.Namespace:
    """The arguments of one load: its rate and concurrency, and its own prompts (seed +
    index), so that a later load on the same server gets no prefix-cache hits from an
    earlier one; lengths and arrivals keep the sweep's seed (``base_seed``)."""
    return argparse.Namespace(**{**vars(args), "max_concurrency": load.concurrency,
                                 "request_rate": load.rate, "seed": args.seed + index,
                                 "base_seed": args.seed})  # fmt: skip


def run_loads(url: str, args: argparse.Namespace, loads: list[Load], mode: str,
              **extra: Any) -> list[dict[str, Any]]:  # fmt: skip
    """Every load against one server, in order; each run tagged with its mode (a line of
    the plots), concurrency (``load``) and rate. ``extra`` goes into the namespace of
    each load (a peer's ``token_id_range``, ``name_model``)."""
    runs: list[dict[str, Any]] = []
    warmup = None
    if getattr(args, "num_warmups", 0) > 0 and loads:  # once per server, before any load
        warm_args = argparse.Namespace(**{**vars(args), **extra})
        warmup = asyncio.run(warm_up(url, warm_args, loads, mode))
    for index, load in enumerate(loads):
        load_args = for_load(args, index, load)
        vars(load_args).update(extra)
        result = asyncio.run(run_load(url, load_args, load.name(mode, loads)))
        rate = "inf" if math.isinf(load.rate) else load.rate  # JSON has no infinity
        result.update(load=load.concurrency, request_rate=rate, mode=mode)
        if index == 0 and warmup is not None:  # the server's warm-up, before this first load
            result["warmup"] = warmup
        runs.append(result)
    return runs
