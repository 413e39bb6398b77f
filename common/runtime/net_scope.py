"""Keep a service's transfer and collective listeners on the interface its address names.

UCX (under every NIXL agent) opens a TCP listener on every network interface, and gloo
binds where the hostname resolves: with ``host = 127.0.0.1`` a prefill's KV agents were
still reachable from outside. Before any agent or process group starts, a service sets
``UCX_NET_DEVICES`` and ``GLOO_SOCKET_IFNAME`` (inherited by its rank processes) to the
interface holding its own address; a wildcard address (0.0.0.0), or one no interface
holds (a hostname, another machine's), leaves them as the operator set them, logged.
Variables the operator set already are kept.
"""

from __future__ import annotations

import fcntl
import ipaddress
import os
import socket
import struct
from urllib.parse import urlsplit

import structlog

from pdserve.common.errors import PdserveError
from pdserve.common.runtime.instance_config import InstanceAddresses

log = structlog.get_logger("pdserve.net")

SIOCGIFADDR = 0x8915  # Linux: an interface's IPv4 address


def host_of(address: str) -> str:
    """``tcp://10.0.0.1:5601`` -> ``10.0.0.1``."""
    return urlsplit(address).hostname or ""


def interface_of(host: str) -> str | None:
    """The network interface holding IPv4 address ``host``; None when none does."""
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return None
    if ip.is_loopback:
        return "lo"
    if ip.is_unspecified or ip.version != 4:
        return None
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for _, name in socket.if_nameindex():
            try:
                raw = fcntl.ioctl(
                    sock.fileno(), SIOCGIFADDR, struct.pack("256s", name[:15].encode())
                )
            except OSError:  # no IPv4 address on it
                continue
            if socket.inet_ntoa(raw[20:24]) == host:
                return name
    return None


def confine_to(address: str) -> str | None:
    """Point UCX and gloo at the interface of ``address``; returns it (None: left open)."""
    host = host_of(address)
    name = interface_of(host)
    if name is None:
        log.warning(
            "transfer_listeners_unconfined",
            address=address,
            hint="UCX/NIXL and gloo listen on every interface; set UCX_NET_DEVICES and "
            "GLOO_SOCKET_IFNAME, or bind the service to one address",
        )
        return None
    os.environ.setdefault("UCX_NET_DEVICES", name)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", name)
    return name


def set_ucx(settings: dict[str, str], lease_seconds: float, heartbeat_seconds: float) -> None:
    """The deployment's ``[ucx]`` settings (UCX_TLS, ...) for NIXL's agents; a variable
    already in the environment (the unit's env file) wins.

    Unless given, ``UCX_TCP_USER_TIMEOUT`` is half the time a producer keeps KV whose
    heartbeats stopped (``lease_seconds - heartbeat_seconds``): a READ over TCP into a
    silent peer (a partition) then fails, and UCX closes its connection, before that
    producer may free and reuse the blocks; without it the READ waits on TCP's own
    retransmissions (~15 minutes) and could land once the partition heals."""
    timeout_ms = int(500 * (lease_seconds - heartbeat_seconds))
    wanted = {"UCX_TCP_USER_TIMEOUT": f"{timeout_ms}ms", **settings}
    for key, value in wanted.items():
        os.environ.setdefault(key, value)
    log.info("ucx_settings", **{k: os.environ[k] for k in wanted})


def check_bindable(service: str, addrs: InstanceAddresses) -> None:
    """Refuse, naming the address, to start a service that binds its advertised address
    when no interface of this machine holds it (its bind would fail with a bare errno: a
    config copied with the wrong --instance, an address of another machine). A service
    with ``bind_host`` may advertise any address (one NAT forwards, say): not checked."""
    if addrs.bind_host:
        return
    for address in (addrs.address, addrs.side_channel):
        host = host_of(address)
        try:
            ipaddress.ip_address(host)
        except ValueError:
            continue  # a hostname: resolved by the peers, not checked here
        if interface_of(host) is None:
            raise PdserveError(
                f"{service} advertises {address}, but no interface of this machine holds "
                f"{host}: peers would connect to another machine. Start --instance N on the "
                "machine whose address the config names, or fix the address"
            )
