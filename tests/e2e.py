"""Helpers for end-to-end tests: real deployments on free local ports."""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any

from pdserve.cli.deployment import Deployment
from pdserve.common.service_config import load_config


def free_port_block(size: int = 100) -> int:
    """A base port with ``size`` free ports above it (checked, then hoped to stay free)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + size > 65000:
            continue
        try:
            for port in range(base, base + size, 10):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
    raise RuntimeError("no free port block")


def deployment(
    tmp: Path, model_dir: Path, engine: dict[str, Any] | None = None, env: dict[str, str] | None = None, **flags: Any
) -> Deployment:
    base = free_port_block()
    cfg = load_config(
        None, model=str(model_dir), base_port=base, http_port=base + 99, torch_threads=1,
        engine={"kv_cache_memory_gb": 0.25, **(engine or {})}, **flags,
    )
    return Deployment(cfg, tmp, env)
