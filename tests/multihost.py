"""A pdserve deployment across hosts of a :class:`tests.netns_hosts.Lab`, started as the
systemd units start it: one TOML file, the same on every host, and on each host
``pdserve ROLE --config FILE --instance N`` (docs/operations.md). CURVE is on (keys from
``pdserve keys``), NIXL goes over UCX's TCP transport (the file's ``[ucx]`` table).

The test process is a client on a host of its own ("client"): every HTTP request, SDK
call and metrics query runs on threads in that host's namespace (:meth:`MultiHost.call`).
Given a :class:`tests.sd_listener.NotifyListener`, every service runs as under systemd's
``Type=notify`` with ``WatchdogSec``: ``NOTIFY_SOCKET``, ``WATCHDOG_USEC`` and
``WATCHDOG_PID`` set, its READY=1 and WATCHDOG=1 datagrams kept with their times.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import zmq

from pdserve.common.runtime.curve import CurveKeys, create_keys
from tests.fault_tools import Peer
from tests.netns_hosts import Lab
from tests.sd_listener import NotifyListener, with_watchdog_pid

T = TypeVar("T")
PREFILL_PORT, SIDE_PORT, DECODE_PORT, ROUTER_PORT, HTTP_PORT = 5610, 5611, 5620, 5600, 8000
CLIENT = "tester"  # the SDK user's key pair (authorized at the front door)


def toml_value(value: Any) -> str:
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {toml_value(v)}" for k, v in value.items()) + "}"
    return json.dumps(value)  # strings, numbers, booleans and lists read the same in TOML


class MultiHost:
    """Router on host "router", prefill i on "prefill{i}", decode i on "decode{i}"."""

    def __init__(
        self,
        lab: Lab,
        work: Path,
        model_dir: Path,
        num_prefill: int,
        num_decode: int,
        settings: dict[str, Any],
        env: dict[str, dict[str, str]] | None = None,
        systemd: NotifyListener | None = None,
    ) -> None:
        self.lab, self.work = lab, work
        self.env = env or {}  # per service name ("decode-1"): its unit's own env file
        self.systemd = systemd  # where set, each service gets its notify socket and watchdog
        for name in (
            ["router", "client"]
            + [f"prefill{i}" for i in range(num_prefill)]
            + [f"decode{i}" for i in range(num_decode)]
        ):
            lab.add_host(name)
        self.keys = work / "keys"
        create_keys(self.keys, (CLIENT,))
        ip = {name: h.ip for name, h in lab.hosts.items()}
        self.front = f"tcp://{ip['router']}:{ROUTER_PORT}"
        self.url = f"http://{ip['router']}:{HTTP_PORT}"
        self.prefill = [
            (f"tcp://{ip[f'prefill{i}']}:{PREFILL_PORT}", f"tcp://{ip[f'prefill{i}']}:{SIDE_PORT}")
            for i in range(num_prefill)
        ]
        self.decode = [f"tcp://{ip[f'decode{i}']}:{DECODE_PORT}" for i in range(num_decode)]
        lines = [
            f"model = {toml_value(str(model_dir))}",
            f"router_address = {toml_value(self.front)}",
            f"http_host = {toml_value(ip['router'])}",
            f"http_port = {HTTP_PORT}",
            "torch_threads = 1",
            *(f"{k} = {toml_value(v)}" for k, v in settings.items() if not isinstance(v, dict)),
        ]
        for address, side in self.prefill:
            lines += ["[[prefill]]", f"address = {toml_value(address)}",
                      f"side_channel = {toml_value(side)}"]  # fmt: skip
        for i, address in enumerate(self.decode):
            lines += ["[[decode]]", f"address = {toml_value(address)}"]
            if i == 1:  # one service bound to every interface: it advertises its address
                lines.append('bind_host = "0.0.0.0"')
        for table, values in settings.items():
            if isinstance(values, dict):
                lines += [f"[{table}]", *(f"{k} = {toml_value(v)}" for k, v in values.items())]
        lines += ["[security]", f"curve_keys_dir = {toml_value(str(self.keys))}"]
        self.config = work / "deploy.toml"
        self.config.write_text("\n".join(lines) + "\n")
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.pool = lab.executor("client", workers=64)
        # The clients' own ZMQ context: libzmq starts its I/O threads at its first socket,
        # made on a client-host thread, so they live in that namespace. The process's
        # shared Context.instance() must not: later tests of this worker use it on loopback.
        self.ctx: Any = zmq.Context()
        self.internal = CurveKeys.client(self.keys)  # the deployment's own pair: services

    # -- services -----------------------------------------------------------------------

    def services(self) -> list[tuple[str, str, list[str]]]:
        """(service name, host, pdserve arguments) of every unit."""
        out = [("router", "router", ["router"])]
        out += [(f"prefill-{i}", f"prefill{i}", ["prefill", "--instance", str(i)])
                for i in range(len(self.prefill))]  # fmt: skip
        out += [(f"decode-{i}", f"decode{i}", ["decode", "--instance", str(i)])
                for i in range(len(self.decode))]  # fmt: skip
        return out

    def start(self, name: str | None = None) -> None:
        """Start every service (or ``name``) as its unit would: a fresh process."""
        pdserve = str(Path(sys.executable).with_name("pdserve"))
        base = {k: v for k, v in os.environ.items() if not k.startswith("PDSERVE_")}
        base.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        for key in ("PDSERVE_CACHE_DIR", "PDSERVE_KERNELS"):
            if key in os.environ:
                base[key] = os.environ[key]
        for service, host, args in self.services():
            if name is not None and service != name:
                continue
            log = open(self.log_path(service), "ab")  # noqa: SIM115 - the process owns it
            env = {**base, **self.env.get(service, {})}
            argv = [pdserve, *args, "--config", str(self.config)]
            if self.systemd is not None:
                env.update(self.systemd.env(service))
                argv = with_watchdog_pid(argv)
            self.procs[service] = self.lab.spawn(host, argv, env, log)
            log.close()

    def log_path(self, service: str) -> Path:
        return self.work / f"{service}.log"

    def signal(self, service: str, sig: signal.Signals) -> None:
        self.procs[service].send_signal(sig)

    def check_alive(self) -> None:
        for service, proc in self.procs.items():
            if proc.poll() is not None:
                tail = self.log_path(service).read_text(errors="replace").splitlines()[-5:]
                raise AssertionError(f"{service} exited {proc.returncode}: {' | '.join(tail)}")

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.check_alive()
            if self.health()[0] == 200:
                return
            time.sleep(0.3)
        raise AssertionError(f"not ready within {timeout:g} s: {self.health()}; logs {self.work}")

    # -- the client host ----------------------------------------------------------------

    def call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """``fn`` run on a thread of the client host (its sockets are made there)."""
        return self.pool.submit(fn, *args, **kwargs).result()

    def health(self) -> tuple[int, dict[str, Any]]:
        def get() -> tuple[int, dict[str, Any]]:
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=3) as resp:
                    return resp.status, json.loads(resp.read() or b"{}")
            except urllib.error.HTTPError as err:
                return err.code, json.loads(err.read() or b"{}")
            except (urllib.error.URLError, ConnectionError, TimeoutError) as exc:
                return 0, {"error": repr(exc)}

        return self.call(get)

    def metrics_text(self) -> str:
        def get() -> str:
            with urllib.request.urlopen(f"{self.url}/metrics", timeout=10) as resp:
                text: str = resp.read().decode()
                return text

        return self.call(get)

    def service_metrics(self, service: str) -> dict[str, float]:
        """One service's counters, asked straight (as a router would), from the client host."""
        role, _, index = service.partition("-")
        address = self.prefill[int(index)][0] if role == "prefill" else self.decode[int(index)]

        def ask() -> dict[str, float]:
            with Peer(address, role, self.internal) as peer:
                return peer.metrics()

        return self.call(ask)

    def pools_idle(self, services: list[str] | None = None) -> bool:
        """Every KV pool back at its free count, and nothing running or waiting."""
        for service in services or [s for s, _, _ in self.services() if s != "router"]:
            m = self.service_metrics(service)
            if m["pdserve:kv_blocks_free"] != m["pdserve:kv_blocks_total"]:
                return False
            if m.get("pdserve:num_requests_running") or m.get("pdserve:num_requests_waiting"):
                return False
        return True

    def client(self, timeout: float = 60.0) -> Any:
        """An SDK client (CURVE, the tester's key); make and use it inside :meth:`call`."""
        from pdserve.services.router.client import Client

        return Client(self.front, timeout=timeout, curve=CurveKeys.client(self.keys, CLIENT),
                      ctx=self.ctx)  # fmt: skip

    def _generate(self, ids: list[int], sampling: dict[str, Any]) -> Any:
        with self.client() as c:
            try:
                return c.generate(prompt_token_ids=ids, **sampling)
            except Exception as exc:  # noqa: BLE001 - the test reads the failure
                return exc

    def generate(self, ids: list[int], **sampling: Any) -> Any:
        """One request through the SDK on the client host: its Result, or its exception."""
        return self.call(self._generate, ids, sampling)

    def submit(self, ids: list[int], **sampling: Any) -> concurrent.futures.Future[Any]:
        """:meth:`generate` in the background."""
        return self.pool.submit(self._generate, ids, sampling)


def raw_requests(
    hosts: MultiHost, prompts: list[list[int]], per_client: int, num_clients: int
) -> tuple[Any, list[Any], dict[tuple[int, str], list[Any]]]:
    """Open ``num_clients`` protocol-level clients on the client host and send each
    ``per_client`` requests (ids ``s<i>``); returns (context, sockets, frames by
    (client, id)) for :func:`abort_and_collect`. Call inside :meth:`MultiHost.call`."""
    import zmq

    from pdserve.common.engine.sampling_params import SamplingParams
    from pdserve.common.runtime import protocol as p
    from pdserve.common.runtime.sockets import make_socket

    ctx: Any = zmq.Context()
    curve = CurveKeys.client(hosts.keys, CLIENT)
    socks = [make_socket(ctx, zmq.DEALER, connect=hosts.front, curve=curve, hwm=100_000)
             for _ in range(num_clients)]  # fmt: skip
    for sock in socks:
        for i in range(per_client):
            generate = p.Generate(request_id=f"s{i}", prompt_token_ids=prompts[i % len(prompts)],
                                  sampling=SamplingParams(max_tokens=8))  # fmt: skip
            sock.send(p.encode(generate))
    return ctx, socks, {}


def abort_and_collect(
    ctx: Any, socks: list[Any], frames: dict[tuple[int, str], list[Any]], per_client: int,
    timeout: float,
) -> float:  # fmt: skip
    """Abort every request of :func:`raw_requests` and read until each has its terminal
    reply; returns when the last Abort left (time.monotonic()). Inside ``call``."""
    import zmq

    from pdserve.common.runtime import protocol as p

    decoder: p.Decoder[Any] = p.Decoder(p.RouterToClient)
    for sock in socks:
        for i in range(per_client):
            sock.send(p.encode(p.Abort(request_id=f"s{i}")))
    sent_at = time.monotonic()
    poller = zmq.Poller()
    for sock in socks:
        poller.register(sock, zmq.POLLIN)
    ended: set[tuple[int, str]] = set()
    deadline = time.monotonic() + timeout
    while len(ended) < per_client * len(socks) and time.monotonic() < deadline:
        for sock, _ in poller.poll(100):
            msg = decoder.decode(sock.recv())
            key = (socks.index(sock), msg.request_id)
            frames.setdefault(key, []).append(msg)
            if isinstance(msg, p.Finished | p.Failed):
                ended.add(key)
    time.sleep(0.5)  # anything after a terminal reply would arrive now
    for sock in socks:
        while sock.poll(0):
            msg = decoder.decode(sock.recv())
            frames.setdefault((socks.index(sock), msg.request_id), []).append(msg)
        sock.close(linger=0)
    ctx.term()
    return sent_at
