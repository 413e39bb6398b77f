"""Tools of the fault suite (tests/test_faults.py).

- :class:`Peer`: a DEALER straight to one service, speaking the router's half of the
  protocol (it never pings, so the service never takes it for a router that went away);
  also reads a service's metrics when the router is dead.
- :func:`wait_until`: every wait of the suite is bounded and says what it waited for.
- :func:`rank_pids`: the rank processes of a prefill coordinator (to kill one).
- :class:`FaultReport`: the table the suite prints and writes as JSON
  (``$PDSERVE_FAULTS_JSON``; benchmarks/faults.py points it at benchmarks/results/).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Self, TypeVar

import msgspec
import zmq

from pdserve.common.runtime import protocol as p
from pdserve.common.runtime.curve import CurveKeys
from pdserve.common.runtime.sockets import make_socket

T = TypeVar("T")
TERMINAL = (p.PrefillDone, p.Finished, p.Failed)


def wait_until(check: Callable[[], T], timeout: float, what: str, interval: float = 0.05) -> T:
    """Poll ``check`` until it returns something true; fail naming ``what`` after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout:g} s: {what} (last: {value!r})")
        time.sleep(interval)


class Peer:
    def __init__(self, address: str, role: str, curve: CurveKeys | None = None) -> None:
        """``curve``: the deployment's client keys, where its internal sockets run CURVE."""
        self.ctx: zmq.Context[Any] = zmq.Context()
        self.sock = make_socket(self.ctx, zmq.DEALER, connect=address, curve=curve)
        self.decoder: p.Decoder[Any] = p.Decoder(
            p.PrefillToRouter if role == "prefill" else p.DecodeToRouter
        )

    def close(self) -> None:
        self.sock.close()
        self.ctx.term()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def send(self, msg: p.Message) -> None:
        self.sock.send(p.encode(msg))

    def ask(self, msg: p.PrefillRequest | p.DecodeRequest, timeout: float = 60.0) -> list[Any]:
        """Send one request; its replies up to and with the terminal one."""
        self.send(msg)
        replies: list[Any] = []
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.sock.poll(100):
                continue
            reply = self.decoder.decode(self.sock.recv())
            if getattr(reply, "request_id", None) != msg.request_id:
                continue
            replies.append(reply)
            if isinstance(reply, TERMINAL):
                return replies
        raise AssertionError(
            f"no terminal reply to {msg.request_id} within {timeout:g} s: {replies}"
        )

    def metrics(self, timeout: float = 10.0) -> dict[str, float]:
        """Counters and gauges of the service, summed over ranks and labels."""
        self.send(p.MetricsQuery())
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.sock.poll(100):
                continue
            reply = self.decoder.decode(self.sock.recv())
            if isinstance(reply, p.MetricsReport):
                out: dict[str, float] = {}
                for s in reply.samples:
                    if s.kind != "histogram":
                        out[s.name] = out.get(s.name, 0.0) + s.value
                return out
        raise AssertionError(f"no metrics within {timeout:g} s")


def service_metrics(address: str, role: str, curve: CurveKeys | None = None) -> dict[str, float]:
    with Peer(address, role, curve) as peer:
        return peer.metrics()


def pools_full(addresses: list[tuple[str, str]], curve: CurveKeys | None = None) -> bool:
    """Every service's KV pool back to its starting free count, and nothing in flight."""
    for address, role in addresses:
        m = service_metrics(address, role, curve)
        if m["pdserve:kv_blocks_free"] != m["pdserve:kv_blocks_total"]:
            return False
        if m.get("pdserve:num_requests_running", 0) or m.get("pdserve:num_requests_waiting", 0):
            return False
    return True


def _stat(pid: int) -> list[str] | None:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text[text.rindex(")") + 2 :].split()  # fields after "pid (comm) "


def is_gone(pid: int) -> bool:
    stat = _stat(pid)
    return stat is None or stat[0] in ("Z", "X")  # exited (a zombie is not reaped yet)


def rank_pids(coordinator_pid: int) -> list[int]:
    """The coordinator's rank processes, oldest (rank 0) first: the children of the
    multiprocessing forkserver the coordinator started (services/ranks/group.py)."""
    servers = [
        pid
        for pid, cmdline in _children(coordinator_pid)
        if b"multiprocessing.forkserver" in cmdline
    ]
    return sorted(pid for server in servers for pid, _ in _children(server))


def _children(parent: int) -> list[tuple[int, bytes]]:
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        stat = _stat(int(entry.name))
        if stat is None or int(stat[1]) != parent:
            continue
        try:
            out.append((int(entry.name), (entry / "cmdline").read_bytes()))
        except OSError:
            continue
    return out


@dataclass
class FaultRow:
    fault: str
    injected: int  # faults injected
    requests: int  # requests affected (in flight at the fault, or sent during it)
    terminal: int  # terminal replies those requests got (must equal requests)
    leaked_blocks: int  # KV blocks not back in their pools afterwards (must be 0)
    detect_seconds: float | None  # fault -> the client's terminal reply / the cleanup
    bound_seconds: float | None  # the documented bound it must stay under
    outcome: str


@dataclass
class FaultReport:
    rows: list[FaultRow] = field(default_factory=list)

    def add(self, row: FaultRow) -> None:
        self.rows.append(row)

    def table(self) -> str:
        head = "| fault | injected | requests | terminal replies | blocks leaked | detected in (s) | bound (s) | outcome |"
        lines = [head, "|" + " --- |" * 8]
        for r in self.rows:
            det = "-" if r.detect_seconds is None else f"{r.detect_seconds:.2f}"
            bound = "-" if r.bound_seconds is None else f"{r.bound_seconds:g}"
            lines.append(
                f"| {r.fault} | {r.injected} | {r.requests} | {r.terminal} | {r.leaked_blocks} | {det} | {bound} | {r.outcome} |"
            )
        return "\n".join(lines)

    def write(self, path: Path, meta: dict[str, Any]) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        body = {"meta": meta, "rows": [asdict(r) for r in self.rows]}
        path.write_text(json.dumps(msgspec.to_builtins(body), indent=1) + "\n")


def report_path(default_dir: Path) -> Path:
    """$PDSERVE_FAULTS_JSON, else faults.json in the session's temporary directory (its own
    for each pytest-xdist worker); under xdist each worker writes its own rows to the named
    file with the worker's id added to its stem."""
    named = os.environ.get("PDSERVE_FAULTS_JSON")
    if not named:
        return default_dir / "faults.json"
    path, worker = Path(named), os.environ.get("PYTEST_XDIST_WORKER")
    return path.with_name(f"{path.stem}-{worker}{path.suffix}") if worker else path
