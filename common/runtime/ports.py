"""Free local TCP ports, taken below the kernel's ephemeral range.

A port found free with ``bind(0)`` lies in the ephemeral range, where the kernel also
hands out the source ports of outgoing connections: between our check and the
service's own ``bind`` a ZeroMQ ``connect`` elsewhere may take it. Ports below that
range are only ever taken by an explicit ``bind``, so a block checked free stays
free unless another process picks the same block on purpose.
"""

from __future__ import annotations

import random
import socket

_LOW = 10000


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port_block(size: int = 1) -> int:
    """A base port with ``size`` consecutive ports free above it, outside the ephemeral range."""
    high = _ephemeral_low() - size
    if high <= _LOW:
        raise RuntimeError(f"no room for {size} ports below the ephemeral range")
    for _ in range(200):
        base = random.randrange(_LOW, high)
        if all(_free(p) for p in range(base, base + size)):
            return base
    raise RuntimeError(f"no block of {size} free ports found")


def free_port() -> int:
    return free_port_block(1)
