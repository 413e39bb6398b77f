"""Long chat prompts through `pdserve up` on the CPU (issue 46): one ~4,000-token chat
prompt alone, then --concurrent distinct ones at once, through the OpenAI SDK against the
HTTP API, each streamed (time to first token and to the whole answer).

    python benchmarks/cpu_long_chat.py [--tokens 4000] [--concurrent 20] [--max-tokens 16]
        [--json benchmarks/results/cpu_long_chat.json] [-- extra `pdserve up` flags]

A fresh deployment of the embedded model (`pdserve up`, its defaults: a prefill and a decode
instance) on free ports; the prompts are random words, distinct per request (no prefix
shared past the chat template), sized with the model's tokenizer to --tokens prompt tokens
(the server's count is recorded too). Beside the wall times, the CPU seconds that the
services spent on the lone prompt (every process under `pdserve up`, psutil): on a busy
machine, the figure that does not depend on the other processes. The JSON records the commit and command, the
machine's load average before and after (other processes on a shared machine add to every
time here), the CPU's flags, and the ISA and kernel choices the services logged
(kernels/cpu_native.py's ``cpu_attention_kernel_loaded`` and ``cpu_kernel_choice`` lines).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import openai

from pdserve.cli.provenance import provenance
from pdserve.common.model.checkpoint.files import resolve_model
from pdserve.kernels import cpu_native

WORDS = (
    "river stone window garden letter market winter silver engine harbor forest candle "
    "pattern signal bridge orbit meadow lantern copper thunder valley mirror circuit "
    "anchor velvet canyon harvest compass"
).split()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def chat_tokens(tokenizer: Any, text: str) -> int:
    """Prompt tokens of one user message once the chat template wraps it."""
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
    )
    return len(tokenizer(rendered, add_special_tokens=False)["input_ids"])


def make_prompt(tokenizer: Any, tokens: int, seed: int) -> str:
    """Random words, about ``tokens`` tokens once the chat template wraps them."""
    rng = random.Random(seed)
    words = [f"Request {seed}:"]
    while chat_tokens(tokenizer, " ".join(words)) < tokens:
        words.extend(rng.choice(WORDS) for _ in range(200))
    while (n := chat_tokens(tokenizer, " ".join(words))) > tokens:  # trim to the count
        words = words[: max(1, len(words) - max(1, (n - tokens) // 2))]
    return " ".join(words)


async def one_chat(client: openai.AsyncOpenAI, model: str, text: str, max_tokens: int) -> dict:
    start = time.perf_counter()
    first = None
    pieces: list[str] = []
    usage = None
    stream = await client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": text}],
        max_tokens=max_tokens,
        temperature=0.0,
        stream=True,
        stream_options={"include_usage": True},
    )
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            if choice.delta.content:
                if first is None:
                    first = time.perf_counter() - start
                pieces.append(choice.delta.content)
    total = time.perf_counter() - start
    return {
        "ttft_s": round(first if first is not None else total, 3),
        "total_s": round(total, 3),
        "prompt_tokens": usage.prompt_tokens if usage else None,
        "completion_tokens": usage.completion_tokens if usage else None,
        # answered: the stream ended with its usage (a finished answer; the model may stop
        # at once with an empty text, which counts)
        "answered": usage is not None and usage.completion_tokens >= 1,
        "text_chars": len("".join(pieces)),
    }


def logged_choices(log_dir: Path) -> list[dict]:
    """The kernel lines the services logged (JSON lines or key=value text)."""
    out = []
    for path in sorted(log_dir.rglob("*")):
        if not path.is_file():
            continue
        for line in path.read_text(errors="replace").splitlines():
            if "cpu_kernel_choice" in line or "cpu_attention_kernel" in line:
                out.append({"file": path.name, "line": line.strip()[:400]})
    return out


def service_cpu_s(server_pid: int) -> float:
    """CPU seconds (user + system) used so far by every process under `pdserve up`."""
    import psutil

    total = 0.0
    for proc in psutil.Process(server_pid).children(recursive=True):
        try:
            t = proc.cpu_times()
        except psutil.Error:
            continue
        total += t.user + t.system
    return total


async def run(
    args: argparse.Namespace, url: str, model: str, tokenizer: Any, server_pid: int
) -> dict:
    client = openai.AsyncOpenAI(
        base_url=f"{url}/v1", api_key="none", timeout=args.timeout, max_retries=0
    )
    text = make_prompt(tokenizer, args.tokens, 0)
    cpu_before = service_cpu_s(server_pid)
    alone = await one_chat(client, model, text, args.max_tokens)
    # the CPU time the services spent on it: what it costs whatever else the machine runs
    # (on a quiet machine of `threads` cores, about cpu_s / threads of wall time)
    alone["service_cpu_s"] = round(service_cpu_s(server_pid) - cpu_before, 2)
    print(f"one {args.tokens}-token prompt: {alone}", file=sys.stderr)
    if args.concurrent == 0:
        await client.close()
        return {"alone": alone, "concurrent": [], "concurrent_wall_s": 0.0}
    texts = [make_prompt(tokenizer, args.tokens, i + 1) for i in range(args.concurrent)]
    start = time.perf_counter()
    results = await asyncio.gather(
        *(one_chat(client, model, t, args.max_tokens) for t in texts), return_exceptions=True
    )
    wall = time.perf_counter() - start
    rows = [
        r if isinstance(r, dict) else {"answered": False, "error": f"{type(r).__name__}: {r}"}
        for r in results
    ]
    await client.close()
    return {"alone": alone, "concurrent": rows, "concurrent_wall_s": round(wall, 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--tokens", type=int, default=4000)
    ap.add_argument("--concurrent", type=int, default=20)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--timeout", type=float, default=1800.0, help="per request, seconds")
    ap.add_argument("--json", default=None)
    ap.add_argument("up_flags", nargs="*", help="after --: extra `pdserve up` flags")
    args = ap.parse_args()
    from transformers import AutoTokenizer

    model_dir = resolve_model(None)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    zmq_port, http_port = free_port(), free_port()
    log_dir = Path(tempfile.mkdtemp(prefix="pdserve-long-chat-"))
    pdserve = Path(sys.executable).with_name("pdserve")
    cmd = [str(pdserve), "up", "--zmq-port", str(zmq_port), "--http-port", str(http_port),
           "--log-dir", str(log_dir), *args.up_flags]  # fmt: skip
    load_before = os.getloadavg()
    server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=open(log_dir / "up.err", "w"))
    url = f"http://127.0.0.1:{http_port}"
    try:
        deadline = time.monotonic() + 600
        while True:
            if server.poll() is not None:
                raise SystemExit(f"pdserve up exited; see {log_dir}")
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    models = httpx.get(f"{url}/v1/models", timeout=5).json()
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise SystemExit("pdserve up not healthy after 600 s")
            time.sleep(1)
        model = models["data"][0]["id"]
        result = asyncio.run(run(args, url, model, tokenizer, server.pid))
    finally:
        server.send_signal(signal.SIGINT)
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
    rows = result["concurrent"]
    answered = sum(bool(r.get("answered")) for r in rows)
    totals = [r["total_s"] for r in rows if "total_s" in r]
    summary = {
        "alone_total_s": result["alone"]["total_s"],
        "alone_ttft_s": result["alone"]["ttft_s"],
        "alone_prompt_tokens": result["alone"]["prompt_tokens"],
        "alone_service_cpu_s": result["alone"]["service_cpu_s"],
        "concurrent_answered": f"{answered}/{len(rows)}",
        "concurrent_max_total_s": max(totals) if totals else None,
        "concurrent_wall_s": result["concurrent_wall_s"],
    }
    print(json.dumps(summary, indent=1))
    if args.json:
        config = {**provenance(), **vars(args), "cpu_count": os.cpu_count(),
                  **cpu_native.describe(), "load_average_before": load_before,
                  "load_average_after": os.getloadavg(), "log_dir": str(log_dir),
                  "service_kernel_lines": logged_choices(log_dir)}  # fmt: skip
        with open(args.json, "w") as f:
            json.dump({"benchmark": "cpu_long_chat", "config": config, "summary": summary,
                       **result}, f, indent=1)  # fmt: skip


if __name__ == "__main__":
    main()
