"""The router process: ZMQ front door + OpenAI-compatible HTTP API over one Router core.

Under systemd (``Type=notify``): READY=1 once both sockets are bound, WATCHDOG=1 from the
asyncio loop. SIGTERM drains: new requests get Failed "draining" (HTTP 503), requests in
flight get ``drain_seconds`` to finish, the rest end with Failed "draining"; exit 0. A
second signal cuts the drain short.
"""

from __future__ import annotations

import asyncio
import signal
from typing import TYPE_CHECKING

import structlog

from pdserve.common.runtime.sd_notify import Watchdog, notify
from pdserve.common.runtime.service_config import DeploymentConfig

if TYPE_CHECKING:
    from pdserve.services.router.router import Router

log = structlog.get_logger("pdserve.router")


async def serve(cfg: DeploymentConfig) -> None:
    from aiohttp import web

    from pdserve.common.model.checkpoint.config import ModelConfig
    from pdserve.common.model.checkpoint.files import resolve_model
    from pdserve.common.model.checkpoint.tokenizer import Tokenizer
    from pdserve.services.router.front import FrontDoor
    from pdserve.services.router.http_api import make_app
    from pdserve.services.router.http_front import ConnectionLimits, GuardedSite
    from pdserve.services.router.router import Router
    from pdserve.services.router.tokenize_pool import TokenizePool

    notify("STATUS=loading the tokenizer (router)")
    model_dir = resolve_model(cfg.model)
    model_cfg = ModelConfig.from_dir(model_dir)
    max_len = cfg.engine.max_model_len or model_cfg.max_position_embeddings
    router = Router(
        cfg, Tokenizer.from_dir(model_dir), model_dir.name, max_len, model_cfg.vocab_size
    )
    await router.start()
    # Long prompts are tokenised there, off this loop's GIL, under their deadline.
    pool = TokenizePool(model_dir, timeout=cfg.tokenize_timeout_seconds,
                        max_waiting=cfg.max_queued_requests)  # fmt: skip
    await pool.start()
    front = FrontDoor(router, cfg.front_address, pool)
    front_task = asyncio.create_task(front.serve())
    # The drain has already ended every request when the runner is cleaned up.
    app = make_app(router, served_model_names=cfg.served_model_names, api_key=cfg.http_keys,
                   allowed_origins=cfg.allowed_origins,
                   tool_call_parser=cfg.tool_call_parser,
                   reasoning_parser=cfg.reasoning_parser, pool=pool,
                   max_prompts=cfg.max_prompts_per_request,
                   max_body_bytes=cfg.max_body_bytes,
                   body_read_timeout=cfg.body_read_timeout_seconds,
                   special_tokens_in_content=cfg.special_tokens_in_content)  # fmt: skip
    # aiohttp closes a connection idle that long after its last answer (its default: an hour)
    runner = web.AppRunner(app, handle_signals=False, access_log=None, shutdown_timeout=2.0,
                           keepalive_timeout=cfg.http_keepalive_timeout_seconds)  # fmt: skip
    await runner.setup()
    # Each connection's headers timed, connections capped per address and in all.
    limits = ConnectionLimits(header_timeout=cfg.http_header_timeout_seconds,
                              max_connections=cfg.max_http_connections,
                              max_connections_per_client=cfg.max_http_connections_per_client)  # fmt: skip
    await GuardedSite(runner, cfg.http_bind_host, cfg.http_port, limits, backlog=1024).start()
    http = f"http://{cfg.http_bind_host}:{cfg.http_port}"
    log.info("router_ready", http=http, zmq=cfg.front_address, api_keys=len(cfg.http_keys),
             served_model_names=cfg.served_model_names or [router.model_name])  # fmt: skip
    stop, stop_now = asyncio.Event(), asyncio.Event()

    def on_signal() -> None:
        if stop.is_set():
            stop_now.set()
        stop.set()

    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal)
    watchdog = Watchdog.from_env()
    watchdog_task = asyncio.create_task(_watchdog(watchdog)) if watchdog is not None else None
    notify(
        "READY=1",
        f"STATUS=router serving {http} and {cfg.front_address}",
    )
    await stop.wait()
    await _drain(router, cfg.drain_seconds, stop_now)
    if watchdog_task is not None:
        watchdog_task.cancel()
    front_task.cancel()
    await runner.cleanup()
    await router.close()
    pool.close()


async def _watchdog(watchdog: Watchdog) -> None:
    # Turns of an eighth of the ping interval: a ping is sent at most that late (a quarter
    # turned 1.5 s pings into 2.25 s ones at a 3 s WatchdogSec); a kick is a clock read.
    while True:
        watchdog.kick()
        await asyncio.sleep(watchdog.interval / 8)


async def _drain(router: Router, seconds: float, stop_now: asyncio.Event) -> None:
    """Refuse new requests; wait up to ``seconds`` for those in flight; fail the rest."""
    router.draining = True
    log.info("router_draining", num_requests=len(router.requests), drain_seconds=seconds)
    notify("STOPPING=1", f"STATUS=draining {len(router.requests)} requests (at most {seconds:g} s)")
    if await _until_idle(router, seconds, stop_now):
        return
    log.warning("drain_timeout", request_ids=list(router.requests), drain_seconds=seconds)
    message = (
        f"the router shut down before the request finished: it drains for at most "
        f"drain_seconds = {seconds:g} s; retry the request"
    )
    router.fail_all("draining", message)
    await _until_idle(router, 2.0, asyncio.Event())  # the front ends send those Faileds


async def _until_idle(router: Router, seconds: float, stop_now: asyncio.Event) -> bool:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + seconds
    while router.requests and not stop_now.is_set():
        remaining = deadline - loop.time()
        if remaining <= 0:
            return False
        try:  # poll: requests end in their own tasks
            await asyncio.wait_for(stop_now.wait(), min(0.05, remaining))
        except TimeoutError:
            pass
    return not router.requests
