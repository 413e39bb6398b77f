"""The router process: ZMQ front door + OpenAI-compatible HTTP API over one Router core."""

from __future__ import annotations

import asyncio
import signal

import structlog

from pdserve.common.service_config import DeploymentConfig

log = structlog.get_logger("pdserve.router")


async def serve(cfg: DeploymentConfig) -> None:
    from aiohttp import web

    from pdserve.common.model_config import ModelConfig
    from pdserve.common.model_files import resolve_model
    from pdserve.common.tokenizer import Tokenizer
    from pdserve.services.router.front import FrontDoor
    from pdserve.services.router.http_api import make_app
    from pdserve.services.router.router import Router

    model_dir = resolve_model(cfg.model)
    model_cfg = ModelConfig.from_dir(model_dir)
    max_len = cfg.engine.max_model_len or model_cfg.max_position_embeddings
    router = Router(cfg, Tokenizer.from_dir(model_dir), model_dir.name, max_len, model_cfg.vocab_size)
    await router.start()
    front = FrontDoor(router, cfg.front_address)
    front_task = asyncio.create_task(front.serve())
    runner = web.AppRunner(make_app(router), handle_signals=False, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, cfg.host, cfg.http_port).start()
    log.info("router_ready", http=f"http://{cfg.host}:{cfg.http_port}", zmq=cfg.front_address)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    front_task.cancel()
    await runner.cleanup()
    await router.close()
