"""Helpers for end-to-end tests: real deployments on free local ports."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pdserve.cli.deployment import Deployment
from pdserve.common.runtime.ports import free_port_block
from pdserve.common.runtime.service_config import load_config


def deployment(
    tmp: Path,
    model_dir: Path,
    engine: dict[str, Any] | None = None,
    env: dict[str, str] | None = None,
    **flags: Any,
) -> Deployment:
    base = free_port_block(100)
    # Most end-to-end tests talk to the services straight, as a router would (tests/fault_tools.py's
    # Peer, without keys): they opt out of the internal CURVE `pdserve up` turns on by default.
    # test_hostile.py runs the default (keys made at start) and test_security.py its own keys.
    flags.setdefault("security", {"insecure": True})
    # Every prompt through a prefill instance, as the tests of the disaggregated path
    # expect; tests of conditional disaggregation (test_local_prefill.py) set a threshold.
    flags.setdefault("local_prefill_threshold", 0)
    cfg = load_config(
        None,
        model=str(model_dir),
        base_port=base,
        http_port=base + 99,
        torch_threads=1,
        engine={"kv_cache_memory_gb": 0.25, **(engine or {})},
        **flags,
    )
    return Deployment(cfg, tmp, env)
