"""``pdserve up`` (serve until Ctrl-C) and ``pdserve demo`` (serve, send real prompts, stop)."""

from __future__ import annotations

import argparse
import signal
import sys
import time
from typing import Any

from pdserve.cli.engine_flags import add_gpu_share, add_kv_cache_dtype

DEMO_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in one sentence what a KV cache is.",
]


def _deployment_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default=None, help="TOML file (PDSERVE_* env and flags override)")
    p.add_argument("--http-port", type=int, default=None)
    p.add_argument(
        "--host",
        default=None,
        help="where the HTTP API binds (default 127.0.0.1; 0.0.0.0: every interface)",
    )
    p.add_argument(
        "--zmq-port",
        type=int,
        default=None,
        help="the router's ZMQ port (the SDK's); the services take the next ports (default 5600)",
    )
    p.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        metavar="NAME",
        help="the model ids the API answers to (default: the model's folder name)",
    )
    p.add_argument(
        "--tool-call-parser",
        choices=("auto", "llama3_json", "hermes"),
        default=None,
        help="how tool calls are read from chat answers (default auto: from the chat template)",
    )
    p.add_argument(
        "--reasoning-parser",
        default=None,
        metavar="NAME",
        help="how chat answers' thinking is split off: qwen3, deepseek_r1, deepseek_v3, "
        "deepseek_v4, deepseek_v41 (vLLM's names), none (default auto: from the chat template)",
    )
    p.add_argument(
        "--no-special-tokens-in-content",
        dest="special_tokens_in_content",
        action="store_false",
        default=None,
        help="tokenise a special token's text in chat message content as plain text, not as "
        "the control token (default: parsed, as vLLM does; special_tokens_in_content)",
    )
    p.add_argument(
        "--allowed-origins",
        nargs="+",
        default=None,
        metavar="ORIGIN",
        help="browser origins CORS lets in, e.g. https://app.example ('*': any)",
    )
    p.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' (or set PDSERVE_API_KEY)",
    )
    p.add_argument("--model", default=None, help="HF directory or GGUF file (default: embedded)")
    p.add_argument("--device", default=None, help="cpu or cuda")
    p.add_argument("--prefill-instances", type=int, default=None)
    p.add_argument("--decode-instances", type=int, default=None)
    p.add_argument(
        "--pcp", type=int, default=None, help="prefill context-parallel ranks per prefill instance"
    )
    p.add_argument(
        "--prefill-tp", type=int, default=None, help="tensor-parallel ranks per prefill PCP rank"
    )
    p.add_argument(
        "--decode-tp", type=int, default=None, help="tensor-parallel ranks per decode instance"
    )
    p.add_argument(
        "--colocated",
        action="store_true",
        default=None,
        help="no prefill service: decode computes prompts",
    )
    p.add_argument(
        "--local-prefill-threshold",
        type=int,
        default=None,
        metavar="TOKENS",
        help="prefill on the decode instance a prompt whose uncached part is shorter than "
        "this, or when every prefill instance is further behind (0: never; default "
        "local_prefill_threshold)",
    )
    add_kv_cache_dtype(p)
    p.add_argument(
        "--kv-host-cache-gb",
        type=float,
        default=None,
        metavar="GIB",
        help="host memory per engine for a tier under the prefix cache: blocks the device pool "
        "evicts are kept there and copied back up on a prefix hit (0: off; default [engine] "
        "kv_host_cache_gb, else 0)",
    )
    add_gpu_share(p)
    p.add_argument("--log-dir", default=None, help="where each process writes its log")
    p.add_argument(
        "--speculative-config",
        default=None,
        metavar="JSON",
        help="speculative decoding on the decode instances (vLLM's JSON, e.g. "
        '\'{"method": "ngram", "num_speculative_tokens": 5}\'); [engine] speculative_config',
    )
    p.add_argument("--curve-keys-dir", default=None,
                   help="CURVE on every ZMQ socket with these keys (`pdserve keys --dir`)")  # fmt: skip
    p.add_argument("--insecure", action="store_true", default=None,
                   help="no CURVE on the internal sockets (by default `up` makes keys for them)")  # fmt: skip


def add_parsers(sub: Any) -> None:
    up = sub.add_parser("up", help="start router, prefill and decode processes; serve until Ctrl-C")
    _deployment_flags(up)
    up.set_defaults(run=run_up)
    demo = sub.add_parser(
        "demo", help="start a deployment, send a few real prompts through it, stop"
    )
    _deployment_flags(demo)
    demo.add_argument("--max-tokens", type=int, default=64)
    demo.set_defaults(run=run_demo)


def _engine_flags(args: argparse.Namespace) -> dict[str, Any] | None:
    flags: dict[str, Any] = {}
    if args.kv_cache_dtype is not None:
        flags["kv_cache_dtype"] = args.kv_cache_dtype
    if args.kv_host_cache_gb is not None:
        flags["kv_host_cache_gb"] = args.kv_host_cache_gb
    if args.speculative_config is not None:
        import msgspec

        from pdserve.common.engine.spec_decode.config import parse_speculative_config

        spec = parse_speculative_config(args.speculative_config)  # a bad flag fails here, once
        flags["speculative_config"] = msgspec.to_builtins(spec)
    return flags or None


def _start(args: argparse.Namespace) -> Any:
    from pathlib import Path

    from pdserve.cli.deployment import Deployment, local_config

    cfg = local_config(
        config=args.config,
        http_port=args.http_port,
        http_host=args.host,
        base_port=args.zmq_port,
        served_model_name=args.served_model_name,
        api_key=args.api_key,
        allowed_origins=args.allowed_origins,
        tool_call_parser=args.tool_call_parser,
        reasoning_parser=args.reasoning_parser,
        special_tokens_in_content=args.special_tokens_in_content,
        model=args.model,
        device=args.device,
        prefill_instances=args.prefill_instances,
        decode_instances=args.decode_instances,
        colocated=args.colocated,
        local_prefill_threshold=args.local_prefill_threshold,
        pcp=args.pcp,
        prefill_tp=args.prefill_tp,
        decode_tp=args.decode_tp,
        engine=_engine_flags(args),
        security={
            k: v
            for k, v in (("curve_keys_dir", args.curve_keys_dir), ("insecure", args.insecure))
            if v is not None
        }
        or None,
    )
    from pdserve.common.runtime.curve import WireSecurity

    # bad keys: one error now, not one per child
    WireSecurity.from_dir(cfg.security.curve_keys_dir, internal_dir=cfg.security.internal_keys_dir)
    if cfg.security.insecure:
        print("--insecure: the internal sockets run without CURVE", file=sys.stderr)
    dep = Deployment(cfg, Path(args.log_dir) if args.log_dir else None, gpu_share=args.gpu_share)
    started = time.monotonic()
    print(
        f"starting {', '.join(name for name, _ in dep.roles())} (logs in {dep.log_dir})",
        file=sys.stderr,
    )
    dep.start()
    try:
        dep.wait_ready()
    except BaseException:
        dep.stop()
        raise
    print(
        f"ready in {time.monotonic() - started:.1f} s: {dep.url}  (OpenAI API at {dep.url}/v1, ZMQ SDK at {cfg.front_address})",
        file=sys.stderr,
    )
    return dep


def run_up(args: argparse.Namespace) -> int:
    dep = _start(args)
    stop = {"now": False}

    def on_signal(signum: int, frame: Any) -> None:
        stop["now"] = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    try:
        while not stop["now"]:
            # Each service on its own, as systemd's Restart=on-failure treats each unit: one
            # that cannot come back is retried with backoff while the others keep serving.
            for event in dep.supervise():
                print(event, file=sys.stderr)
            time.sleep(0.5)
    finally:
        codes = dep.stop()
        print(f"stopped: {codes}", file=sys.stderr)
    return 0


def _sdk_keys(cfg: Any) -> Any:
    from pdserve.common.runtime.curve import CurveKeys

    keys_dir = cfg.security.curve_keys_dir
    return CurveKeys.client(keys_dir) if keys_dir else None


def run_demo(args: argparse.Namespace) -> int:
    import json
    import urllib.request

    from pdserve.services.router.client import Client

    dep = _start(args)
    try:
        for prompt in DEMO_PROMPTS:
            body = json.dumps(
                {
                    "messages": [{"role": "user", "content": prompt}],
                    "max_tokens": args.max_tokens,
                    "temperature": 0,
                }
            ).encode()
            headers = {"Content-Type": "application/json"}
            if dep.cfg.api_key:
                headers["Authorization"] = f"Bearer {dep.cfg.api_key}"
            req = urllib.request.Request(f"{dep.url}/v1/chat/completions", body, headers)
            with urllib.request.urlopen(req, timeout=300) as resp:
                answer = json.loads(resp.read())["choices"][0]["message"]["content"]
            print(f"> {prompt}  [HTTP /v1/chat/completions]\n{answer.strip()}\n")
        with Client(dep.cfg.front_address, curve=_sdk_keys(dep.cfg)) as client:
            result = client.generate(
                prompt="The three primary colors are", max_tokens=args.max_tokens, temperature=0.0
            )
        print(f"> The three primary colors are  [ZMQ SDK, raw completion]\n{result.text.strip()}\n")
    finally:
        dep.stop()
    return 0
