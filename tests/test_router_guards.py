"""LoopLag: a loop's own stall is measured, counted, and not blamed on its peers."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdserve.common.runtime.loop_lag import LoopLag
from pdserve.common.runtime.metrics import Metrics


def test_a_stall_is_measured_beyond_the_interval_and_counted() -> None:
    now = [100.0]
    metrics = Metrics("router", 0)
    lag = LoopLag(0.5, metrics, clock=lambda: now[0])
    assert lag.tick() == 0.0  # the first tick has nothing to compare with
    now[0] += 0.52
    assert lag.tick() == pytest.approx(0.02)  # on time: jitter, no stall
    assert metrics.value("pdserve:loop_stalls") == 0
    now[0] += 8.5  # the loop was blocked for 8 s
    assert lag.tick() == pytest.approx(8.0)
    assert metrics.value("pdserve:loop_stalls") == 1
    assert metrics.value("pdserve:loop_lag_seconds") == pytest.approx(8.0)


def test_the_sdk_refuses_what_the_http_api_refuses() -> None:
    from pdserve.common.errors import RequestError
    from pdserve.services.router.client_common import build_request

    for kwargs, words in (
        ({"request_id": "x" * 129}, "1-128 printable"),
        ({"request_id": "has space"}, "1-128 printable"),
        ({"prompt_token_ids": [], "prompt": None}, "prompt_token_ids is empty"),
        ({"prompt_token_ids": [1, -2], "prompt": None}, "ints >= 0"),
        ({"prompt": ""}, "the prompt is empty"),
    ):
        args: dict = {"prompt": "hi", "prompt_token_ids": None, "request_id": None, **kwargs}
        with pytest.raises(RequestError, match=words):
            build_request(
                args["prompt"], args["prompt_token_ids"], None, args["request_id"], True, {}
            )
    assert build_request("hi", None, None, "ok-id_1", True, {}).request_id == "ok-id_1"


def test_internal_keys_alone_leave_the_front_door_open(tmp_path: Path) -> None:
    from pdserve.common.runtime.curve import WireSecurity, create_keys
    from pdserve.common.runtime.instance_config import SecurityConfig

    create_keys(tmp_path)
    metrics = Metrics("router", 0)
    internal = WireSecurity.counted(SecurityConfig(internal_keys_dir=str(tmp_path)), metrics)
    assert internal.server is not None and internal.client is not None and internal.front is None
    full = WireSecurity.counted(SecurityConfig(curve_keys_dir=str(tmp_path)), metrics)
    assert full.server is not None and full.front is not None
    off = WireSecurity.counted(SecurityConfig(insecure=True), metrics)
    assert off == WireSecurity()
