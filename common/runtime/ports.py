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
_range: tuple[int, int] | None = None  # set_port_range's, else [_LOW, the ephemeral range)


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


def default_port_range() -> tuple[int, int]:
    """[10000, the start of the ephemeral range): where blocks are taken by default."""
    return _LOW, _ephemeral_low()


def set_port_range(low: int, high: int) -> None:
    """Take this process's blocks from [low, high) only: processes that pick ports at once
    (parallel test workers) get disjoint ranges, so no two check the same block free."""
    if not 0 < low < high <= _ephemeral_low():
        raise ValueError(f"port range [{low}, {high}) is not below the ephemeral range")
    global _range
    _range = (low, high)


def free_port_block(size: int = 1) -> int:
    """A base port with ``size`` consecutive ports free above it, outside the ephemeral range."""
    low, high = _range or default_port_range()
    high -= size
    if high <= low:
        raise RuntimeError(f"no room for {size} ports in [{low}, {high + size})")
    for _ in range(200):
        base = random.randrange(low, high)
        if all(_free(p) for p in range(base, base + size)):
            return base
    raise RuntimeError(f"no block of {size} free ports found")


def free_port() -> int:
    return free_port_block(1)
