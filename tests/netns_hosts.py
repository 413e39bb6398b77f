"""Hosts as Linux network namespaces on one switch, for tests of a deployment across
machines (tests/test_multihost.py).

A :class:`Lab` makes a switch (a bridge in a namespace of its own) and hosts: each host a
namespace whose one interface, ``eth0`` with a private address (10.77.0.N/24), is a veth
whose other end is a port of that bridge. Nothing is added to the machine's own namespace:
the addresses never reach its network, and two labs (parallel test workers) use the same
addresses in different switches without meeting. Names carry a random suffix.

Faults between hosts:

- :meth:`Lab.cut` / :meth:`Lab.heal`: two hosts stop hearing each other, silently, as
  with a cable pulled between them (each resolves the other's address to a MAC no host
  has: frames are flooded and dropped, TCP retransmits into the void); every other pair
  still talks. No packet filter is needed (this machine's kernel has no tc or netfilter
  modules).
- :meth:`Lab.unplug` / :meth:`Lab.plug`: a host's port on the switch down and up.

Processes run in a host with ``ip netns exec`` (:meth:`Lab.spawn`); the test's own sockets
(HTTP, ZeroMQ) are made by threads that entered a host's namespace
(:meth:`Lab.executor`): a thread's sockets, and the threads it starts (ZeroMQ's I/O
threads), stay in the namespace the thread was in when it made them.

Every process started in a host is killed and every namespace deleted at :meth:`Lab.close`,
on a test's failure (the context manager) and at the interpreter's exit (atexit).
"""

from __future__ import annotations

import atexit
import concurrent.futures
import ctypes
import functools
import os
import secrets
import shutil
import signal
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Self

SUBNET = "10.77.0"
CLONE_NEWNET = 0x40000000
_NETNS_DIR = Path("/var/run/netns")


@functools.cache
def unavailable() -> str | None:
    """Why this machine cannot run a lab (None: it can): not root, no ``ip``, no netns."""
    if os.geteuid() != 0:
        return "network namespaces need root (CI runs the slow lane as root)"
    if shutil.which("ip") is None:
        return "iproute2's `ip` is not installed"
    probe = f"pdprobe-{secrets.token_hex(3)}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")


def _enter(netns: str) -> None:
    """Move the calling thread into namespace ``netns`` (threads it starts follow it)."""
    fd = os.open(_NETNS_DIR / netns, os.O_RDONLY)
    try:
        if ctypes.CDLL(None, use_errno=True).setns(fd, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns into {netns}")
    finally:
        os.close(fd)


@dataclass
class Host:
    name: str
    netns: str
    ip: str
    port: str  # its port on the switch
    mac: str = ""


@dataclass
class Lab:
    tag: str = field(default_factory=lambda: secrets.token_hex(3))
    hosts: dict[str, Host] = field(default_factory=dict)
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    pools: list[concurrent.futures.ThreadPoolExecutor] = field(default_factory=list)
    closed: bool = False

    @property
    def switch(self) -> str:
        return f"pd{self.tag}-sw"

    def __enter__(self) -> Self:
        atexit.register(self.close)  # a test run killed by an exception still cleans up
        _ip("netns", "add", self.switch)
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def add_host(self, name: str) -> Host:
        host = Host(name, f"pd{self.tag}-{name}", f"{SUBNET}.{10 + len(self.hosts)}",
                    f"p{len(self.hosts)}")  # fmt: skip
        self.hosts[name] = host
        _ip("netns", "add", host.netns)
        _ip("-n", host.netns, "link", "add", "eth0", "type", "veth",
            "peer", "name", host.port, "netns", self.switch)  # fmt: skip
        _ip("-n", self.switch, "link", "set", host.port, "master", "br0", "up")
        _ip("-n", host.netns, "addr", "add", f"{host.ip}/24", "dev", "eth0")
        _ip("-n", host.netns, "link", "set", "eth0", "up")
        _ip("-n", host.netns, "link", "set", "lo", "up")
        out = subprocess.run(["ip", "-n", host.netns, "-br", "link", "show", "eth0"],
                             capture_output=True, text=True, check=True).stdout  # fmt: skip
        host.mac = out.split()[2]
        return host

    # -- faults -------------------------------------------------------------------------

    def cut(self, a: str, b: str) -> None:
        """``a`` and ``b`` stop hearing each other (both ways), silently."""
        for one, other in ((a, b), (b, a)):
            _ip("-n", self.hosts[one].netns, "neigh", "replace", self.hosts[other].ip,
                "lladdr", "02:00:00:00:00:01", "dev", "eth0", "nud", "permanent")  # fmt: skip

    def heal(self, a: str, b: str) -> None:
        for one, other in ((a, b), (b, a)):
            _ip("-n", self.hosts[one].netns, "neigh", "replace", self.hosts[other].ip,
                "lladdr", self.hosts[other].mac, "dev", "eth0", "nud", "reachable")  # fmt: skip

    def unplug(self, name: str) -> None:
        _ip("-n", self.switch, "link", "set", self.hosts[name].port, "down")

    def plug(self, name: str) -> None:
        _ip("-n", self.switch, "link", "set", self.hosts[name].port, "up")

    # -- processes and sockets ----------------------------------------------------------

    def spawn(
        self, host: str, argv: list[str], env: dict[str, str], log: IO[bytes]
    ) -> subprocess.Popen[bytes]:
        """``argv`` run in ``host`` (its own process group, so a kill takes its children)."""
        proc = subprocess.Popen(
            ["ip", "netns", "exec", self.hosts[host].netns, *argv],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.procs.append(proc)
        return proc

    def executor(self, host: str, workers: int = 4) -> concurrent.futures.ThreadPoolExecutor:
        """Threads whose sockets live in ``host``: the test's client on that host."""
        pool = concurrent.futures.ThreadPoolExecutor(
            workers, f"netns-{host}", initializer=_enter, initargs=(self.hosts[host].netns,)
        )
        self.pools.append(pool)
        return pool

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for proc in self.procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait()
        for pool in self.pools:
            pool.shutdown(wait=False, cancel_futures=True)
        # Deleting a host's namespace deletes its veth and so the switch's port of it.
        for netns in [h.netns for h in self.hosts.values()] + [self.switch]:
            subprocess.run(["ip", "netns", "del", netns], capture_output=True)
        atexit.unregister(self.close)
