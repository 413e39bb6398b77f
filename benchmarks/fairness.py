"""Issue 49's case: one client's backlog beside another client's short requests.

Starts `pdserve up` (the embedded default model unless --model; CPU unless --device) with
``trust_user_field`` on, so the two clients, both on this host, are told apart by the
OpenAI ``user`` field, and runs three phases against it:

1. idle: client B alone sends --probe-count short requests, one every 2 s (its idle latency);
2. alone: client A sends --burst completions at once (max_tokens 64), nothing else: A's
   throughput alone (completion tokens of its 200 answers over the time to the last one);
3. both: A's burst again, B one short request every 2 s until A's last answer.

Ratios are to the same run's idle / alone phases: B's latency p50 and max against its idle
p50, A's throughput against alone. The floor of B's ratio is measured too: the mean gap
between two tokens of a stream (the router's pdserve:inter_token_latency_seconds) while
A's burst runs alone, over that gap in B's idle phase: B's few tokens each wait for a step
of A's whole batch, which no order shortens. The machine's load is recorded per phase, and decode's model steps during A's burst by
kind (replayed from a CUDA graph, or eager: a prefill chunk among the decodes).

    python benchmarks/fairness.py --json benchmarks/results/fairness_cpu.json
    python benchmarks/fairness.py --device cuda --model DIR --json .../fairness_gpu.json
    python benchmarks/fairness.py ... --up-arg=--local-prefill-threshold=0  # every prompt
                                          # through prefill: decode's steps stay graphs
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import aiohttp

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def token_gaps(url: str) -> tuple[float, float]:
    """The router's inter-token latency histogram: (sum of seconds, count)."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as resp:
        text = resp.read().decode()
    total = count = 0.0
    for line in text.splitlines():
        if line.startswith("pdserve:inter_token_latency_seconds_sum{"):
            total += float(line.rsplit(" ", 1)[1])
        elif line.startswith("pdserve:inter_token_latency_seconds_count{"):
            count += float(line.rsplit(" ", 1)[1])
    return total, count


def model_steps(url: str) -> dict[str, float]:
    """The decode instances' model steps by kind (pdserve:model_steps_total): ``graph``
    (a decode step replayed from a CUDA graph) and ``eager`` (any other: a prefill chunk
    among the decodes, every step on CPU)."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as resp:
        text = resp.read().decode()
    steps = {"graph": 0.0, "eager": 0.0}
    for line in text.splitlines():
        if line.startswith("pdserve:model_steps_total{") and 'service="decode"' in line:
            kind = line.split('kind="', 1)[1].split('"', 1)[0]
            steps[kind] = steps.get(kind, 0.0) + float(line.rsplit(" ", 1)[1])
    return steps


def mean_gap(before: tuple[float, float], after: tuple[float, float]) -> float:
    """Mean seconds between two tokens of a stream over a phase (every client's)."""
    num = after[1] - before[1]
    return round((after[0] - before[0]) / num, 4) if num else float("nan")


def load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


async def complete(session: aiohttp.ClientSession, url: str, user: str, prompt: str,
                   max_tokens: int) -> tuple[int, int, float]:  # fmt: skip
    """(status, completion tokens, seconds) of one completion."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "user": user}
    started = time.monotonic()
    async with session.post(f"{url}/v1/completions", json=body) as resp:
        data = await resp.json(content_type=None)
        tokens = data.get("usage", {}).get("completion_tokens", 0) if resp.status == 200 else 0
        return resp.status, tokens, time.monotonic() - started


async def burst(session: aiohttp.ClientSession, url: str, n: int) -> dict[str, Any]:
    """Client A: n completions at once; its throughput over the time to the last 200."""
    started = time.monotonic()
    done: list[float] = []

    async def one(k: int) -> tuple[int, int, float]:
        out = await complete(session, url, "bulk", f"Request {k}: write a story about", 64)
        if out[0] == 200:
            done.append(time.monotonic() - started)
        return out

    results = await asyncio.gather(*(one(k) for k in range(n)))
    statuses: dict[str, int] = {}
    for status, _, _ in results:
        statuses[str(status)] = statuses.get(str(status), 0) + 1
    tokens = sum(t for _, t, _ in results)
    span = max(done) if done else float("nan")
    return {"statuses": statuses, "completion_tokens": tokens, "seconds": round(span, 2),
            "tokens_per_second": round(tokens / span, 2) if done else 0.0}  # fmt: skip


async def probes(session: aiohttp.ClientSession, url: str, max_tokens: int,
                 count: int | None, until: asyncio.Future[Any] | None) -> list[float]:  # fmt: skip
    """Client B: one short request every 2 s (``count`` of them, or until ``until``)."""
    latencies: list[float] = []
    k = 0
    while (count is None or k < count) and (until is None or not until.done()):
        tick = time.monotonic()
        status, _, seconds = await complete(session, url, "interactive",
                                            f"Question {k}: the capital of France is",
                                            max_tokens)  # fmt: skip
        if status != 200:
            raise RuntimeError(f"client B's request {k} answered {status}")
        latencies.append(round(seconds, 3))
        k += 1
        await asyncio.sleep(max(0.0, 2.0 - (time.monotonic() - tick)))
    return latencies


def summary(latencies: list[float]) -> dict[str, float]:
    return {"p50": round(statistics.median(latencies), 3), "max": max(latencies),
            "n": len(latencies)}  # fmt: skip


async def run(url: str, args: argparse.Namespace) -> dict[str, Any]:
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=1800)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        for _ in range(3):  # warm
            await complete(session, url, "interactive", "Hello", args.probe_tokens)
        out: dict[str, Any] = {}
        out["load_before"] = load()
        gaps = token_gaps(url)
        idle = await probes(session, url, args.probe_tokens, args.probe_count, None)
        gaps, gaps_before = token_gaps(url), gaps
        out["idle"] = {"b_latency": summary(idle), "latencies": idle, "load": load(),
                       "token_gap_seconds": mean_gap(gaps_before, gaps)}  # fmt: skip
        steps = model_steps(url)
        alone = await burst(session, url, args.burst)
        gaps, gaps_before = token_gaps(url), gaps
        steps, steps_before = model_steps(url), steps
        out["alone"] = {
            "a": alone,
            "load": load(),
            "token_gap_seconds": mean_gap(gaps_before, gaps),
            # decode's steps during A's burst: how many a CUDA graph replayed
            "decode_steps": {k: steps[k] - steps_before.get(k, 0.0) for k in steps},
        }
        await asyncio.sleep(2)
        a_task = asyncio.ensure_future(burst(session, url, args.burst))
        await asyncio.sleep(0.5)  # the burst is in
        loaded = await probes(session, url, args.probe_tokens, None, a_task)
        both = await a_task
        out["both"] = {"a": both, "b_latency": summary(loaded), "latencies": loaded,
                       "load": load()}  # fmt: skip
    idle_p50 = out["idle"]["b_latency"]["p50"]
    out["ratios"] = {
        "b_p50_over_idle": round(out["both"]["b_latency"]["p50"] / idle_p50, 2),
        "b_max_over_idle": round(out["both"]["b_latency"]["max"] / idle_p50, 2),
        # the floor of B's ratio: a token of a stream beside A's batch against one alone
        # (B's requests are mostly token gaps; no order makes A's batch step faster)
        "token_gap_alone_over_idle": round(
            out["alone"]["token_gap_seconds"] / out["idle"]["token_gap_seconds"], 2
        ),
        "a_throughput_over_alone": round(
            both["tokens_per_second"] / max(alone["tokens_per_second"], 1e-9), 3
        ),
    }
    r = out["ratios"]
    out["holds"] = {"b_p50_within_2x": r["b_p50_over_idle"] <= 2.0,
                    "b_max_within_4x": r["b_max_over_idle"] <= 4.0,
                    "a_within_10pct": r["a_throughput_over_alone"] >= 0.9}  # fmt: skip
    return out


def wait_healthy(url: str, proc: subprocess.Popen[bytes], seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"pdserve up exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=5) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1)
    raise RuntimeError(f"{url} not healthy within {seconds:g} s")


def client_metrics(url: str) -> list[str]:
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return [line for line in text.splitlines()
            if line.startswith(("pdserve:client_served_tokens", "pdserve:abandoned_tokens"))]  # fmt: skip


def main() -> int:
    from pdserve.cli.provenance import command_line, environment, git_commit

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="model directory (default: embedded)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--http-port", type=int, default=8150)
    parser.add_argument("--base-port", type=int, default=5850)
    parser.add_argument("--burst", type=int, default=1000, help="client A's completions at once")
    parser.add_argument("--probe-tokens", type=int, default=8, help="client B's max_tokens")
    parser.add_argument("--probe-count", type=int, default=6, help="client B's idle requests")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--up-arg", action="append", default=[],
                        help="one more argument of `pdserve up`, e.g. "
                        "--up-arg=--local-prefill-threshold=0 (repeatable)")  # fmt: skip
    parser.add_argument(
        "--url",
        default=None,
        help="a running deployment (with trust_user_field) instead of starting one",
    )
    args = parser.parse_args()
    proc = None
    url = args.url
    if url is None:
        url = f"http://127.0.0.1:{args.http_port}"
        cmd = [sys.executable, "-m", "pdserve", "up", "--http-port", str(args.http_port),
               "--device", args.device]  # fmt: skip
        if args.model:
            cmd += ["--model", args.model]
        cmd += args.up_arg
        env = {**os.environ, "PDSERVE_TRUST_USER_FIELD": "true",
               "PDSERVE_BASE_PORT": str(args.base_port)}  # fmt: skip
        proc = subprocess.Popen(cmd, env=env, start_new_session=True)
    try:
        if proc is not None:
            wait_healthy(url, proc, 600)
        out = asyncio.run(run(url, args))
        out["metrics"] = client_metrics(url)
    finally:
        if proc is not None:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(60)
    out = {"commit": git_commit(), "command": command_line(), "environment": environment(),
           "device": args.device, "up_args": args.up_arg,
           "model": args.model or "embedded", "burst": args.burst,
           "probe_max_tokens": args.probe_tokens, "cpu_count": os.cpu_count(), **out}  # fmt: skip
    text = json.dumps(out, indent=1)
    print(text)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(text + "\n")
    return 0 if all(out["holds"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
