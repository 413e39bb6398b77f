"""Issue 50 on a real `pdserve up` deployment (router, prefill, decode processes; the
embedded model unless --model): no request stalls the others.

1. grammar: 4 users stream chat completions; the max gap between two of a stream's token
   events is measured in a window with the streams alone (the floor, same run, same
   machine load) and in a window where 14 hostile requests arrive beside them: tool
   schemas nested 360 levels deep (12 HTTP, ~14 KB bodies, tool_choice required: the
   issue's case, refused at the router; 2 SDK requests whose schema text is as deep,
   refused by the engines' compile worker); then, in a window of their own, 2 schemas
   at the router's depth limit (compiled off the engine thread, then served). Windows of
   the streams alone before, between and after are the floor. Each request's answer and
   time is recorded; each gap over 0.5 s with its offset in its window.
2. connections: --stalled connections (default 20,000) from 16 loopback addresses (each
   address's in one burst, past its cap of max_http_connections_per_client) send half a
   request's headers and stall; /health, a chat completion and an SDK request from
   another address are timed every 0.5 s, from 5 s before the storm (the floor) to its
   end; every stalled one must have been answered (408 at the header deadline, or 503 at
   once past a cap) and closed.

    python benchmarks/hostile.py                     # both, ~2 min on 2 cores
    python benchmarks/hostile.py --stalled 2000      # a smaller connection storm

Writes benchmarks/results/hostile.json (commit, command, uptime's load) and prints a table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULT = ROOT / "benchmarks" / "results" / "hostile.json"
STALLED = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Le"


def nested_schema(levels: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string"}
    for i in range(levels):
        schema = {"type": "object", "properties": {f"p{i % 10}": schema}}
    return schema


def tool_body(levels: int, max_tokens: int = 8) -> dict[str, Any]:
    return {
        "model": None,
        "messages": [{"role": "user", "content": "call f"}],
        "tools": [
            {"type": "function", "function": {"name": "f", "parameters": nested_schema(levels)}}
        ],
        "tool_choice": "required",
        "max_tokens": max_tokens,
    }


async def stream(
    session: Any, url: str, stop: asyncio.Event, gaps: list[tuple[float, float]]
) -> int:
    """One user: chat streams one after another until ``stop``; each token event's
    arrival appended to ``gaps`` as (time, gap since the previous event of its stream)."""
    body = {"messages": [{"role": "user", "content": "Tell me a long story."}], "stream": True,
            "max_tokens": 256, "ignore_eos": True, "temperature": 0}  # fmt: skip
    tokens = 0
    while not stop.is_set():
        async with session.post(f"{url}/v1/chat/completions", json=body) as response:
            assert response.status == 200, await response.text()
            last = None
            async for line in response.content:
                if not line.startswith(b"data: {"):
                    continue
                now = time.monotonic()
                if last is not None:
                    gaps.append((now, now - last))
                last = now
                tokens += 1
                if stop.is_set():
                    break
    return tokens


def max_gap(gaps: list[tuple[float, float]], start: float, end: float) -> float:
    inside = [g for t, g in gaps if start <= t - g and t <= end]
    return max(inside, default=0.0)


async def grammar_phase(dep: Any, window: float) -> dict[str, Any]:
    """Windows of ``window`` s over the same 4 streams: the first structured request
    (xgrammar's one-time load in prefill and decode), the streams alone, the 14 hostile
    requests beside them, the streams alone again."""
    import aiohttp

    from pdserve.common.engine.sampling_params import StructuredOutput
    from pdserve.services.router.client import Client

    url = dep.url
    gaps: list[tuple[float, float]] = []
    stop = asyncio.Event()
    results: list[dict[str, Any]] = []
    windows: dict[str, tuple[float, float]] = {}

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as session:

        async def http_one(kind: str, levels: int, salt: int = 0) -> None:
            body = tool_body(levels)
            body["tools"][0]["function"]["name"] = f"f{salt}"  # a schema of its own: no cache hit
            t0 = time.monotonic()
            async with session.post(f"{url}/v1/chat/completions", json=body) as r:
                data = await r.json()
            message = data.get("error", {}).get("message", "")[:120] if r.status != 200 else ""
            results.append({"kind": kind, "status": r.status, "seconds": time.monotonic() - t0,
                            "message": message})  # fmt: skip

        def sdk_one() -> None:
            spec = StructuredOutput(kind="json", spec=json.dumps(nested_schema(360)))
            t0 = time.monotonic()
            with Client(dep.cfg.front_address, timeout=60) as client:
                try:
                    client.generate(prompt_token_ids=[1, 2, 3], max_tokens=4, structured=spec)
                    status, message = 200, ""
                except Exception as exc:  # noqa: BLE001 - the refusal is the expected answer
                    status, message = 400, str(exc)[:120]
            results.append({"kind": "sdk 360 levels (schema text)", "status": status,
                            "seconds": time.monotonic() - t0, "message": message})  # fmt: skip

        async def timed(name: str, work: Any) -> None:
            start = time.monotonic()
            await work
            await asyncio.sleep(max(0.0, window - (time.monotonic() - start)))
            windows[name] = (start, time.monotonic())

        users = [asyncio.create_task(stream(session, url, stop, gaps)) for _ in range(4)]
        await asyncio.sleep(5)  # the streams under way
        await timed("first structured request (xgrammar load)",
                    http_one("first structured request (xgrammar load)", 3))  # fmt: skip
        await timed("alone", asyncio.sleep(0))
        deep = [http_one("http tools 360 levels, required", 360) for _ in range(12)]
        deep += [asyncio.to_thread(sdk_one) for _ in range(2)]
        await timed("beside 14 deep-schema requests", asyncio.gather(*deep))
        await timed("alone again", asyncio.sleep(0))
        compiled = [http_one("http tools 29 levels (at the limit), compiled", 29, k)
                    for k in range(1, 3)]  # fmt: skip
        await timed("beside 2 at-limit schemas compiled", asyncio.gather(*compiled))
        await timed("alone, third", asyncio.sleep(0))
        stop.set()
        tokens = await asyncio.gather(*users)
    return {
        "streams": 4,
        "tokens_streamed": sum(tokens),
        "window_seconds": window,
        "windows": {
            name: {
                "seconds": end - start,
                "max_gap_s": max_gap(gaps, start, end),
                "gaps_over_1s": sum(1 for t, g in gaps if start <= t - g and t <= end and g > 1.0),
                "gaps_over_half_s_at": [
                    (round(t - g - start, 2), round(g, 3))
                    for t, g in gaps
                    if start <= t - g and t <= end and g > 0.5
                ],  # fmt: skip
            }
            for name, (start, end) in windows.items()
        },  # fmt: skip
        "hostile": results,
    }


async def connection_phase(dep: Any, num: int, header_timeout: float) -> dict[str, Any]:
    import aiohttp

    from pdserve.services.router.client import Client

    host, port = "127.0.0.1", dep.cfg.http_port
    addresses = [f"127.0.0.{2 + i}" for i in range(16)]
    conns: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
    answers: dict[str, int] = {}
    probes: list[dict[str, Any]] = []
    stop = asyncio.Event()

    async def probe_loop() -> None:
        sdk = Client(dep.cfg.front_address, timeout=60)
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
            while not stop.is_set():
                row: dict[str, Any] = {"t": time.monotonic()}
                for name, coro in (
                    ("health", session.get(f"{dep.url}/health")),
                    ("chat", session.post(f"{dep.url}/v1/chat/completions", json={
                        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})),
                ):  # fmt: skip
                    t0 = time.monotonic()
                    try:
                        async with coro as r:
                            await r.read()
                            row[name] = r.status
                    except Exception as exc:  # noqa: BLE001 - recorded as the failure it is
                        row[name] = type(exc).__name__
                    row[f"{name}_s"] = time.monotonic() - t0
                t0 = time.monotonic()
                try:
                    await asyncio.to_thread(sdk.generate, prompt_token_ids=[1, 2, 3], max_tokens=4)
                    row["sdk"] = "ok"
                except Exception as exc:  # noqa: BLE001
                    row["sdk"] = type(exc).__name__
                row["sdk_s"] = time.monotonic() - t0
                probes.append(row)
                await asyncio.sleep(0.5)
        sdk.close()

    async def read_answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                          opened: float) -> None:  # fmt: skip
        try:
            raw = await asyncio.wait_for(reader.read(), header_timeout + 60)
            status = raw.split(b" ", 2)[1].decode() if raw.startswith(b"HTTP/") else "closed"
        except Exception as exc:  # noqa: BLE001
            status = type(exc).__name__
        answers[status] = answers.get(status, 0) + 1
        closed_after.append(time.monotonic() - opened)
        writer.close()  # this end's descriptor back, as a real client's would be

    closed_after: list[float] = []
    probe = asyncio.create_task(probe_loop())
    await asyncio.sleep(5)  # probes before the storm: the floor, same run
    storm_start = t0 = time.monotonic()
    readers = []
    open_failures: dict[str, int] = {}
    per_address = -(-num // len(addresses))
    for i in range(num):
        source = addresses[i // per_address]  # each address's connections in one burst
        try:
            reader, writer = await asyncio.open_connection(host, port, local_addr=(source, 0))
            writer.write(STALLED)
            conns.append((reader, writer))
            readers.append(asyncio.create_task(read_answer(reader, writer, time.monotonic())))
        except OSError as exc:
            open_failures[exc.strerror or str(exc)] = open_failures.get(exc.strerror or "", 0) + 1
        if i % 500 == 0:
            await asyncio.sleep(0)
    opened = time.monotonic() - t0
    await asyncio.gather(*readers)
    all_closed = time.monotonic() - t0
    stop.set()
    await probe
    for _, writer in conns:
        writer.close()
    before = [p for p in probes if p["t"] < storm_start]
    during = [p for p in probes if p["t"] >= storm_start]
    statuses = {k: sum(1 for p in during if p[k] in (200, "ok")) for k in ("health", "chat", "sdk")}
    return {
        "stalled_connections": num,
        "source_addresses": len(addresses),
        "open_seconds": opened,
        "open_failures": open_failures,
        "answers": answers,
        "all_closed_after_s": all_closed,
        "longest_held_s": max(closed_after, default=0.0),
        "header_timeout_s": header_timeout,
        "probes": len(during),
        "probes_ok": statuses,
        "worst_probe_s": {
            k: max((p[f"{k}_s"] for p in during), default=0.0) for k in ("health", "chat", "sdk")
        },  # fmt: skip
        "probes_before": len(before),
        "worst_probe_before_s": {
            k: max((p[f"{k}_s"] for p in before), default=0.0) for k in ("health", "chat", "sdk")
        },  # fmt: skip
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="model directory (default: embedded)")
    parser.add_argument("--stalled", type=int, default=20_000)
    parser.add_argument("--window", type=float, default=15.0, help="seconds per gap window")
    parser.add_argument("--skip", choices=("grammar", "connections"), default=None)
    parser.add_argument("--json", type=Path, default=RESULT)
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    from pdserve.cli.deployment import Deployment, local_config
    from pdserve.cli.provenance import command_line, environment, git_commit
    from pdserve.common.runtime.ports import free_port_block

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    base = free_port_block(100)
    cfg = local_config(model=args.model, base_port=base, http_port=base + 99)
    out: dict[str, Any] = {
        "commit": git_commit(),
        "command": command_line(),
        "environment": environment(),
        "nofile_limit": hard,
        "load_before": os.getloadavg(),
        "uptime_before": subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip(),
        "settings": {
            "http_header_timeout_seconds": cfg.http_header_timeout_seconds,
            "max_http_connections_per_client": cfg.max_http_connections_per_client,
            "max_http_connections": cfg.max_http_connections or "derived",
        },  # fmt: skip
    }
    with Deployment(cfg, Path(tempfile.mkdtemp(prefix="pdserve-hostile-"))) as dep:
        dep.wait_ready(600)
        if args.skip != "grammar":
            out["grammar"] = asyncio.run(grammar_phase(dep, args.window))
            out["load_after_grammar"] = os.getloadavg()
        if args.skip != "connections":
            out["connections"] = asyncio.run(
                connection_phase(dep, args.stalled, cfg.http_header_timeout_seconds)
            )
        dep.check_alive()
    out["load_after"] = os.getloadavg()
    out["uptime_after"] = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(out, indent=1) + "\n")
    print(table(out))
    return 0


def table(out: dict[str, Any]) -> str:
    lines = [f"commit {out['commit']}; load {out['load_before']} -> {out['load_after']}", ""]
    if "grammar" in out:
        g = out["grammar"]
        lines += ["| 4 streams, window | length | max inter-token gap | gaps > 1 s |",
                  "| --- | --- | --- | --- |"]  # fmt: skip
        for name, w in g["windows"].items():
            lines.append(f"| {name} | {w['seconds']:.1f} s | {w['max_gap_s']:.3f} s | "
                         f"{w['gaps_over_1s']} |")  # fmt: skip
        lines += ["", "| request | answers | slowest |", "| --- | --- | --- |"]
        kinds: dict[str, list[dict[str, Any]]] = {}
        for r in g["hostile"]:
            kinds.setdefault(r["kind"], []).append(r)
        for kind, rows in kinds.items():
            statuses = ", ".join(f"{s} x{sum(1 for r in rows if r['status'] == s)}"
                                 for s in sorted({r["status"] for r in rows}))  # fmt: skip
            lines.append(f"| {kind} | {statuses} | {max(r['seconds'] for r in rows):.2f} s |")
        lines.append("")
    if "connections" in out:
        c = out["connections"]
        lines += [
            f"| {c['stalled_connections']} stalled connections | |",
            "| --- | --- |",
            f"| answers | {c['answers']} |",
            f"| all closed after | {c['all_closed_after_s']:.1f} s (header timeout "
            f"{c['header_timeout_s']:g} s) |",
            f"| probes ok (health, chat, sdk) of {c['probes']} | {c['probes_ok']} |",
            f"| worst probe during | {', '.join(f'{k} {v:.2f} s' for k, v in c['worst_probe_s'].items())} |",
            f"| worst probe before ({c['probes_before']}) | "
            f"{', '.join(f'{k} {v:.2f} s' for k, v in c['worst_probe_before_s'].items())} |",
        ]
    return "\n".join(lines)


if __name__ == "__main__":
    threading.excepthook = lambda a: None  # a probe thread's late error is in the JSON
    sys.exit(main())
