"""Start router, prefill and decode as separate OS processes and watch them.

Used by ``pdserve up``, ``pdserve demo`` and the end-to-end tests: the same code path a
user runs. Each process runs ``pdserve ROLE --config FILE`` forked from a zygote that
imported the service code once (cli/zygote.py); logs go to one file per process.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import msgspec

from pdserve.cli.service_process import zygote_for
from pdserve.cli.supervisor import Supervisor
from pdserve.common.errors import PdserveError
from pdserve.common.runtime.service_config import DeploymentConfig

if TYPE_CHECKING:
    from pdserve.cli.gpu_share import GpuShare, MpsDaemon


class ServiceHandle(Protocol):
    """A running service process: a zygote's child (cli/zygote.py) or a Popen."""

    pid: int

    @property
    def returncode(self) -> int | None: ...

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...

    def send_signal(self, sig: int) -> None: ...

    def kill(self) -> None: ...


class Deployment:
    def __init__(
        self,
        cfg: DeploymentConfig,
        log_dir: Path | None = None,
        env: dict[str, str] | None = None,
        gpu_share: GpuShare | None = None,
    ) -> None:
        self.cfg = cfg
        self.extra_env = env or {}
        # both roles on one GPU (cli/gpu_share.py): the MPS daemon used, each role's env
        self.gpu_share = gpu_share
        self.mps: MpsDaemon | None = None
        self.role_env: dict[str, dict[str, str]] = {}
        self.log_dir = log_dir or Path(tempfile.mkdtemp(prefix="pdserve-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.config_path = self.log_dir / "deployment.json"
        self.procs: dict[str, ServiceHandle] = {}
        self.num_restarts: dict[str, int] = {}
        self.supervisor: Supervisor | None = None  # once started
        self.made_keys: Path | None = None  # the runtime key directory start() made, if any

    @property
    def url(self) -> str:
        return self.cfg.http_url

    def roles(self) -> list[tuple[str, list[str]]]:
        out = []
        if not self.cfg.colocated:
            out += [
                (f"prefill-{i}", ["prefill", "--instance", str(i)])
                for i in range(len(self.cfg.prefill_addresses))
            ]
        out += [
            (f"decode-{i}", ["decode", "--instance", str(i)])
            for i in range(len(self.cfg.decode_addresses))
        ]
        return out + [("router", ["router"])]

    def start(self) -> None:
        sec = self.cfg.security
        if not sec.internal_keys and not sec.insecure:
            # Secure by default: the internal sockets get CURVE with this deployment's own
            # keys, made in a private directory that only the children are told of.
            from pdserve.common.runtime.curve import make_runtime_keys

            self.made_keys = make_runtime_keys()
            self.cfg = msgspec.structs.replace(
                self.cfg,
                security=msgspec.structs.replace(sec, internal_keys_dir=str(self.made_keys)),
            )
        report = self.log_dir / "supervision.json"
        report.unlink(missing_ok=True)  # a report of an earlier deployment in this directory
        self.cfg = msgspec.structs.replace(self.cfg, supervisor_file=str(report))
        # Owner-only: it may hold the API key.
        self.config_path.touch(mode=0o600)
        self.config_path.chmod(0o600)
        self.config_path.write_bytes(json.dumps(msgspec.to_builtins(self.cfg), indent=1).encode())
        # The children get their configuration from the file alone, not from PDSERVE_* env.
        env = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith("PDSERVE_")
            or k in ("PDSERVE_CACHE_DIR", "PDSERVE_KERNELS", "PDSERVE_CPU_ISA")
        }
        # Under systemd, `pdserve up` itself is the unit's main process, not its children.
        for key in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID"):
            env.pop(key, None)
        env.update(self.extra_env)
        try:
            self._start_mps(env)
        except BaseException:
            if self.made_keys is not None:  # nothing was started: leave nothing behind
                shutil.rmtree(self.made_keys, ignore_errors=True)
                self.made_keys = None
            raise
        self._env = env
        for name, args in self.roles():
            self._spawn(name, args, env, "wb")
        self.supervisor = Supervisor(self, report)

    def _start_mps(self, env: dict[str, str]) -> None:
        """``gpu_share`` (cli/gpu_share.py): on one GPU, the MPS daemon the services reach
        (found, or started here and stopped by ``stop``) and each role's SM share."""
        if self.gpu_share is None:
            return
        from pdserve.cli.gpu_share import plan, start_mps

        use, note = plan(self.gpu_share, self.cfg.device, self.cfg.colocated, env)
        if note:
            print(note, file=sys.stderr)
        if not use:
            return
        self.mps = start_mps(self.log_dir, env)
        env.update(self.mps.env)
        self.role_env = self.gpu_share.role_env()
        print(f"CUDA MPS ({'started' if self.mps.started else 'running'}, pipes in "
              f"{self.mps.pipe_dir}): {self.gpu_share.describe()}", file=sys.stderr)  # fmt: skip

    def _spawn(self, name: str, args: list[str], env: dict[str, str], log_mode: str) -> None:
        env = {**env, **self.role_env.get(name.partition("-")[0], {})}
        self.procs[name] = zygote_for(env).spawn(
            name,
            [*args, "--config", str(self.config_path)],
            env,
            str(self.log_path(name)),
            log_mode == "ab",
        )

    def log_path(self, name: str) -> Path:
        return self.log_dir / f"{name}.log"

    def last_log_lines(self, name: str, num: int) -> list[str]:
        """The last ``num`` non-empty lines of process ``name``'s log."""
        try:
            text = self.log_path(name).read_text(errors="replace")
        except OSError:
            return []
        return [line for line in text.splitlines() if line.strip()][-num:]

    def addresses_of(self, name: str) -> list[str]:
        """The addresses process ``name`` binds (to name who holds one when it cannot)."""
        role, _, index = name.partition("-")
        if role == "router":
            host = self.cfg.http_bind_host
            host = f"[{host}]" if ":" in host else host
            return [self.cfg.front_address, f"tcp://{host}:{self.cfg.http_port}"]
        table = self.cfg.prefill_addresses if role == "prefill" else self.cfg.decode_addresses
        addrs = table[int(index)]
        return [a for a in (addrs.address, addrs.side_channel) if a]

    def kill(self, name: str) -> int:
        """SIGKILL process ``name`` (fault injection); returns its pid."""
        proc = self.procs[name]
        proc.kill()
        proc.wait()
        return proc.pid

    def supervise(self, now: float | None = None) -> list[str]:
        """One look at the processes, as systemd's Restart=on-failure takes for each unit:
        restart what failed, after its backoff (cli/supervisor.py); one line per event."""
        if self.supervisor is None:
            raise PdserveError("the deployment is not started")
        return self.supervisor.step(now)

    def restart(self, name: str, env: dict[str, str] | None = None) -> None:
        """Start process ``name`` again once it has exited, as systemd's Restart= does;
        ``env`` adds variables for this process only. Its log continues in the same file."""
        if self.procs[name].poll() is None:
            raise PdserveError(f"{name} is still running (pid {self.procs[name].pid})")
        self._spawn(name, dict(self.roles())[name], {**self._env, **(env or {})}, "ab")
        self.num_restarts[name] = self.num_restarts.get(name, 0) + 1

    def wait_ready(self, timeout: float = 600.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.check_alive()
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as resp:
                    if resp.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.3)
        raise PdserveError(
            f"the deployment was not ready within {timeout:.0f} s; logs in {self.log_dir}"
        )

    def check_alive(self) -> None:
        for name, proc in self.procs.items():
            code = proc.poll()
            if code is not None:
                tail = self.last_log_lines(name, 5)
                raise PdserveError(
                    f"{name} exited with code {code}; last log lines: {' | '.join(tail)}"
                )

    def stop(self, timeout: float | None = None) -> dict[str, int | None]:
        """SIGTERM every process (each drains, see docs/operations.md); kill what is still
        running after ``timeout`` (default: the drain time and 15 s to spare)."""
        if timeout is None:
            timeout = self.cfg.drain_seconds + 15.0
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        codes: dict[str, int | None] = {}
        for name, proc in self.procs.items():
            try:
                codes[name] = proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                codes[name] = proc.wait()
        if self.made_keys is not None:
            shutil.rmtree(self.made_keys, ignore_errors=True)
            self.made_keys = None
        if self.mps is not None:  # after its clients: quit only what this deployment started
            self.mps.stop()
            self.mps = None
        return codes

    def __enter__(self) -> Deployment:
        self.start()
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def local_config(**flags: Any) -> DeploymentConfig:
    """The config of ``pdserve up``: file < env < flags, threads split among the processes."""
    from pdserve.common.runtime.service_config import load_config

    path = flags.pop("config", None)
    cfg = load_config(path, **flags)
    if cfg.torch_threads == 0:
        cores = os.cpu_count() or 1
        num = cfg.decode_instances + (0 if cfg.colocated else cfg.prefill_instances)
        cfg = msgspec.structs.replace(cfg, torch_threads=max(1, cores // num))
        if not cfg.colocated and cfg.prefill_torch_threads == 0 and cfg.pcp * cfg.prefill_tp == 1:
            # Prefill works in bursts: a one-rank prefill instance gets its share of every
            # core, not of the services' split; the OS shares them with decode when both run
            # (2 cores: a 4,000-token chat prompt answered in 10.5 s instead of 17.8 s; 20
            # at once all answered, in 189 s instead of 166 s: benchmarks/README.md, #46).
            cfg = msgspec.structs.replace(
                cfg, prefill_torch_threads=max(1, cores // cfg.prefill_instances)
            )
    return cfg
