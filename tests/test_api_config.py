"""`pdserve up`'s API flags: served model names, HTTP host, API key, ZMQ port."""

from __future__ import annotations

import pytest

from pdserve.cli.deployment import local_config
from pdserve.cli.main import build_parser
from pdserve.common.errors import PdserveError
from pdserve.common.runtime.service_config import load_config, torch_threads_for


def _up_config(argv: list[str]) -> object:
    args = build_parser().parse_args(["up", *argv])
    flags = {"http_port": args.http_port, "http_host": args.host, "base_port": args.zmq_port,
             "served_model_name": args.served_model_name, "api_key": args.api_key,
             "allowed_origins": args.allowed_origins}  # fmt: skip
    return local_config(config=None, **flags)


def test_up_flags_reach_the_config(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PDSERVE_API_KEY", raising=False)
    cfg = _up_config(["--served-model-name", "a", "b", "--host", "0.0.0.0", "--zmq-port", "6100",
                      "--api-key", "k", "--http-port", "9001", "--allowed-origins", "*"])  # fmt: skip
    assert cfg.served_model_names == ["a", "b"] and cfg.api_key == "k"
    assert cfg.allowed_origins == ["*"]
    assert cfg.http_bind_host == "0.0.0.0" and cfg.http_url == "http://127.0.0.1:9001"
    assert cfg.front_address == "tcp://127.0.0.1:6100"
    assert cfg.decode_addresses[0].address == "tcp://127.0.0.1:6120"  # services follow the base
    default = _up_config([])
    assert default.http_bind_host == "127.0.0.1" and default.served_model_names == []
    assert default.api_key == "" and default.front_address == "tcp://127.0.0.1:5600"


def test_api_key_and_names_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDSERVE_API_KEY", "from-env")
    monkeypatch.setenv("PDSERVE_SERVED_MODEL_NAME", "solo")
    cfg = load_config(None)
    assert cfg.api_key == "from-env" and cfg.served_model_names == ["solo"]
    assert load_config(None, api_key="flag").api_key == "flag"  # flags win


def test_empty_model_name_is_refused() -> None:
    with pytest.raises(PdserveError, match="served_model_name"):
        load_config(None, served_model_name=["ok", ""])


def test_torch_threads_split_per_role(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDSERVE_DECODE_TORCH_THREADS", "3")
    cfg = load_config(None, torch_threads=2)
    assert (torch_threads_for(cfg, "decode"), torch_threads_for(cfg, "prefill")) == (3, 2)
    monkeypatch.delenv("PDSERVE_DECODE_TORCH_THREADS")
    monkeypatch.setattr("os.cpu_count", lambda: 8)
    split = local_config(colocated=False)  # decode half the cores, the bursty prefill all
    assert (torch_threads_for(split, "prefill"), torch_threads_for(split, "decode")) == (8, 4)
    two = local_config(colocated=False, prefill_instances=2)  # each prefill: its share
    assert (torch_threads_for(two, "prefill"), torch_threads_for(two, "decode")) == (4, 2)
    pcp = local_config(colocated=False, pcp=2)  # ranks: the services' split, as before
    assert torch_threads_for(pcp, "prefill") == 4
    mine = local_config(colocated=False, prefill_torch_threads=1)  # a setting wins
    assert torch_threads_for(mine, "prefill") == 1
    alone = local_config(colocated=True)  # decode computes the prompts too: every core
    assert torch_threads_for(alone, "decode") == 8
    with pytest.raises(PdserveError, match="prefill_torch_threads must be 0"):
        load_config(None, prefill_torch_threads=-1)
