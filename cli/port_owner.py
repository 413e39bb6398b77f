"""Which process holds a local TCP port: the cause a launcher names when a service it
restarts cannot bind its address (Linux /proc; elsewhere nothing is found).

/proc/net/tcp and tcp6 list every socket with its local port and inode; a process's
/proc/PID/fd links name the inodes it holds (``socket:[INODE]``). Another user's
processes are not readable without privileges: their sockets are found, their pid not.
"""

from __future__ import annotations

import os
from pathlib import Path

_TABLES = ("/proc/net/tcp", "/proc/net/tcp6")


def port_of(address: str) -> int | None:
    """The port of ``tcp://HOST:PORT`` (IPv6 hosts in brackets); None for other transports."""
    if not address.startswith("tcp://"):
        return None
    _, _, port = address.rpartition(":")
    return int(port) if port.isdigit() else None


def _bound_inodes(port: int) -> set[int]:
    """Inodes of sockets bound to ``port`` and not connected (listening, or bound only)."""
    inodes = set()
    for table in _TABLES:
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            # sl local_address rem_address st tx:rx tr:when retrnsmt uid timeout inode
            if len(fields) < 10 or int(fields[1].rpartition(":")[2], 16) != port:
                continue
            if int(fields[2].rpartition(":")[2], 16) == 0 and int(fields[9]) != 0:
                inodes.add(int(fields[9]))
    return inodes


def _holders(inodes: set[int]) -> list[int]:
    links = {f"socket:[{inode}]" for inode in inodes}
    pids = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            fds = os.scandir(f"/proc/{entry.name}/fd")
        except OSError:  # gone, or another user's
            continue
        with fds:
            for fd in fds:
                try:
                    if os.readlink(fd.path) in links:
                        pids.append(int(entry.name))
                        break
                except OSError:
                    continue
    return sorted(pids)


def _command(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return "?"


def port_holder(address: str) -> str | None:
    """Who holds ``address``'s port, in words (``tcp://127.0.0.1:5620 is in use by pid
    4242 (python3)``); None when nothing holds it or the address is not TCP."""
    port = port_of(address)
    if port is None:
        return None
    try:
        inodes = _bound_inodes(port)
        pids = _holders(inodes) if inodes else []
    except (OSError, ValueError):  # no /proc, or a table this parser does not know
        return None
    if not inodes:
        return None
    if not pids:
        return f"{address} is in use by a process this user cannot see"
    who = ", ".join(f"pid {pid} ({_command(pid)})" for pid in pids)
    return f"{address} is in use by {who}"
