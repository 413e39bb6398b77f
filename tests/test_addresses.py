"""Advertised versus bound addresses, and the deployment's UCX settings (issue #41)."""

from __future__ import annotations

import os

import pytest

from pdserve.common.errors import PdserveError
from pdserve.common.runtime.instance_config import InstanceAddresses
from pdserve.common.runtime.net_scope import check_bindable, set_ucx
from pdserve.common.runtime.service_config import load_config


def test_a_wildcard_address_is_refused_naming_bind_host_and_where() -> None:
    with pytest.raises(PdserveError, match=r"wildcard.*bind_host.*\$\.decode\[1\]"):
        load_config(None, decode=[{"address": "tcp://10.0.0.2:5620"},
                                  {"address": "tcp://0.0.0.0:5630"}])  # fmt: skip
    with pytest.raises(PdserveError, match=r"side_channel tcp://0.0.0.0:5611.*\$\.prefill\[0\]"):
        load_config(None, prefill=[{"address": "tcp://10.0.0.1:5610",
                                    "side_channel": "tcp://0.0.0.0:5611"}])  # fmt: skip


def test_bind_host_binds_the_advertised_ports() -> None:
    addrs = InstanceAddresses(
        address="tcp://10.0.0.2:5620", side_channel="tcp://10.0.0.2:5621", bind_host="0.0.0.0"
    )
    assert addrs.bound(addrs.address) == "tcp://0.0.0.0:5620"
    assert addrs.bound(addrs.side_channel) == "tcp://0.0.0.0:5621"
    assert InstanceAddresses(address="tcp://10.0.0.2:5620").bound("tcp://10.0.0.2:5620") == (
        "tcp://10.0.0.2:5620"
    )


def test_derived_addresses_of_a_wildcard_host_are_reached_on_loopback() -> None:
    cfg = load_config(None, host="0.0.0.0", base_port=7000)
    prefill = cfg.prefill_addresses[0]
    assert prefill.address == "tcp://127.0.0.1:7010" and prefill.bind_host == "0.0.0.0"
    assert prefill.bound(prefill.side_channel) == "tcp://0.0.0.0:7011"


def test_an_address_of_another_machine_is_refused_at_start() -> None:
    with pytest.raises(PdserveError, match="decode 1 advertises tcp://10.255.7.7:5620"):
        check_bindable("decode 1", InstanceAddresses(address="tcp://10.255.7.7:5620"))
    check_bindable("decode 0", InstanceAddresses(address="tcp://127.0.0.1:5620"))
    # bound to every interface, it may advertise an address it does not hold (NAT)
    check_bindable("decode 1", InstanceAddresses(address="tcp://10.255.7.7:5620",
                                                 bind_host="0.0.0.0"))  # fmt: skip


def test_ucx_settings_are_checked_and_the_environment_wins(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with pytest.raises(PdserveError, match=r"\[ucx\] holds UCX_\* variables only, got TLS"):
        load_config(None, ucx={"TLS": "tcp"})
    cfg = load_config(None, ucx={"UCX_TLS": "tcp", "UCX_TCP_KEEPINTVL": "1s"})
    monkeypatch.setenv("UCX_TLS", "rc,cuda_copy")
    monkeypatch.delenv("UCX_TCP_KEEPINTVL", raising=False)
    monkeypatch.delenv("UCX_TCP_USER_TIMEOUT", raising=False)
    set_ucx(cfg.ucx, cfg.lease_seconds, cfg.heartbeat_seconds)
    assert os.environ["UCX_TLS"] == "rc,cuda_copy"
    assert os.environ["UCX_TCP_KEEPINTVL"] == "1s"
    # a READ into a silent peer fails before its producer's lease may end (30 s - 5 s)
    assert os.environ["UCX_TCP_USER_TIMEOUT"] == "12500ms"
