"""``pdserve up``'s supervision, one service at a time: what systemd's
``Restart=on-failure`` without a start limit does for each unit (deploy/systemd/; there
``RestartSteps=`` and ``RestartMaxDelaySec=``, systemd >= 254, give the same backoff).

A service that exits with a failure starts again after ``restart_seconds``, doubling with
each failed life in a row up to ``restart_max_seconds``, forever: a service that cannot
come back (its port held by another process, its GPU gone) never takes the healthy ones
down with it. A life that lasted ``restart_max_seconds`` resets the count. An exit 0 (the
process was stopped) or 2 (a configuration error, which a restart cannot mend) is not
restarted, as ``RestartPreventExitStatus=2`` keeps a unit down; the others keep serving.
Each exit is reported with its cause: a line on the launcher's stderr, and the report the
router shows in ``/health`` and ``/metrics`` (common/runtime/supervision.py).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from pdserve.cli.port_owner import port_holder
from pdserve.common.errors import PdserveError
from pdserve.common.runtime.supervision import (
    RESTARTING,
    RUNNING,
    STOPPED,
    ServiceReport,
    SupervisionReport,
    write_report,
)

if TYPE_CHECKING:
    from pdserve.common.runtime.service_config import DeploymentConfig


class Polled(Protocol):
    def poll(self) -> int | None: ...


class Supervised(Protocol):
    """What the supervisor needs of a started deployment (cli/deployment.py's Deployment):
    a protocol, so that the deployment, which owns its supervisor, is not imported here."""

    @property
    def cfg(self) -> DeploymentConfig: ...
    @property
    def procs(self) -> Mapping[str, Polled]: ...

    def log_path(self, name: str) -> Path: ...
    def last_log_lines(self, name: str, num: int) -> list[str]: ...
    def addresses_of(self, name: str) -> list[str]: ...
    def restart(self, name: str, env: dict[str, str] | None = None) -> None: ...


NOT_RESTARTED = {0: "it was stopped", 2: "a configuration error"}
MAX_CAUSE_CHARS = 400


def restart_delay(num_failures: int, first: float, cap: float) -> float:
    """The wait before the next start of a service whose last ``num_failures`` lives failed."""
    return min(cap, first * 2 ** max(0, num_failures - 1))


@dataclass
class Life:
    """One service's supervision state (times: monotonic, but for the report's)."""

    started_at: float
    state: str = RUNNING
    num_restarts: int = 0
    num_failures: int = 0
    cause: str = ""
    down_since: float = 0.0  # wall clock
    next_start: float = 0.0  # monotonic

    def report(self, now: float) -> ServiceReport:
        waiting = self.state == RESTARTING
        return ServiceReport(
            state=self.state,
            num_restarts=self.num_restarts,
            num_failures=self.num_failures,
            cause=self.cause,
            down_since=self.down_since,
            next_start_at=time.time() + max(0.0, self.next_start - now) if waiting else 0.0,
        )


class Supervisor:
    """Watches a started Deployment's processes; :meth:`step` is one look at them."""

    def __init__(self, dep: Supervised, report_path: Path) -> None:
        self.dep = dep
        self.first = dep.cfg.restart_seconds
        self.cap = dep.cfg.restart_max_seconds
        self.report_path = report_path
        self.report_failed = False  # told once: the services matter more than their report
        now = time.monotonic()
        self.lives = {name: Life(started_at=now) for name in dep.procs}
        self._write(now)

    def step(self, now: float | None = None) -> list[str]:
        """Notice exits, start again the services whose wait is over; one line per event."""
        now = time.monotonic() if now is None else now
        events = []
        for name, proc in list(self.dep.procs.items()):
            life = self.lives.setdefault(name, Life(started_at=now))
            if life.state == RUNNING:
                code = proc.poll()
                if code is not None:
                    events.append(self._exited(name, life, code, now))
            elif life.state == RESTARTING and now >= life.next_start:
                events.append(self._start(name, life, now))
        if events:
            events += self._write(now)
        return events

    def _exited(self, name: str, life: Life, code: int, now: float) -> str:
        if now - life.started_at >= self.cap:
            life.num_failures = 0  # it had served a while: this failure starts a new run
        if life.num_failures == 0:  # down since it last served, not since its last try
            life.down_since = time.time()
        life.cause = self.cause(name, code)
        log = self.dep.log_path(name)
        if code in NOT_RESTARTED:
            life.state = STOPPED
            return (f"{name} exited with code {code} ({NOT_RESTARTED[code]}): not restarting "
                    f"it; the other services keep serving. {life.cause} (log: {log})")  # fmt: skip
        life.state = RESTARTING
        life.num_failures += 1
        delay = restart_delay(life.num_failures, self.first, self.cap)
        life.next_start = now + delay
        return (f"{name} failed ({life.cause}); starting it again in {delay:g} s "
                f"(failure {life.num_failures} in a row; log: {log})")  # fmt: skip

    def _start(self, name: str, life: Life, now: float) -> str:
        try:
            self.dep.restart(name)
        except PdserveError as exc:  # the zygote could not fork it: try again later
            life.num_failures += 1
            life.cause = str(exc)
            delay = restart_delay(life.num_failures, self.first, self.cap)
            life.next_start = now + delay
            return f"could not start {name} ({exc}); trying again in {delay:g} s"
        life.state, life.started_at = RUNNING, now
        life.num_restarts += 1
        return f"started {name} again (restart {life.num_restarts})"

    def cause(self, name: str, code: int) -> str:
        """Why ``name``'s life ended, as far as the launcher can tell: its exit code, which
        of its addresses another process holds (and which), its last log line."""
        parts = [f"exit code {code}"]
        parts += [held for a in self.dep.addresses_of(name) if (held := port_holder(a))]
        last = self.dep.last_log_lines(name, 1)
        if last:
            parts.append(f"last log line: {last[0]}")
        text = "; ".join(parts)
        return text if len(text) <= MAX_CAUSE_CHARS else text[: MAX_CAUSE_CHARS - 3] + "..."

    def _write(self, now: float) -> list[str]:
        services = {name: life.report(now) for name, life in self.lives.items()}
        try:
            write_report(self.report_path, SupervisionReport(services=services))
        except OSError as exc:  # its directory removed, a disk full: the services go on
            if not self.report_failed:
                self.report_failed = True
                return [f"could not write the supervision report the router reads ({exc}); "
                        "/health will not name the causes of services that are down"]  # fmt: skip
        else:
            self.report_failed = False
        return []
