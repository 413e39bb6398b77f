"""What ``pdserve up``'s launcher tells the router about the services it supervises.

The launcher (cli/supervisor.py) restarts a service that exited with a failure, forever,
with a capped backoff, while the other services keep serving. Only the launcher knows why
a service is down (its exit code, a port another process holds, its last log line), and
only the router answers ``/health`` and ``/metrics``: the launcher writes a small JSON
report (``supervisor_file`` in the deployment's config) each time a service changes state,
and the router reads it when asked. Under systemd there is no report: systemd and journald
hold the same facts (``systemctl status``, ``NRestarts``).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import msgspec

from pdserve.common.runtime.protocol import MetricSample

RUNNING, RESTARTING, STOPPED = "running", "restarting", "stopped"


class ServiceReport(msgspec.Struct, kw_only=True):
    # running: the process is up (it may still be loading); restarting: it exited with a
    # failure and starts again at next_start_at; stopped: it exited 0 or 2 (a configuration
    # error), which a restart cannot mend: it stays down, as under RestartPreventExitStatus=2
    state: str
    num_restarts: int = 0  # starts after the first, in this launcher's life
    num_failures: int = 0  # failed lives in a row (the backoff's step; 0 once one lasted)
    cause: str = ""  # why its last life ended: exit code, the port in use and by whom, ...
    down_since: float = 0.0  # wall-clock time of that exit
    next_start_at: float = 0.0  # wall-clock time of the next start (restarting only)


class SupervisionReport(msgspec.Struct, kw_only=True):
    services: dict[str, ServiceReport] = {}  # by process name: router, prefill-0, decode-1


_decode = msgspec.json.Decoder(SupervisionReport).decode


def write_report(path: Path, report: SupervisionReport) -> None:
    """Replace the report at once (a reader sees the old one or the new one, never half)."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(msgspec.json.encode(report))
    os.replace(tmp, path)


def read_report(path: str) -> SupervisionReport | None:
    """The launcher's latest report; None without one (systemd, or nothing written yet)."""
    if not path:
        return None
    try:
        return _decode(Path(path).read_bytes())
    except (OSError, msgspec.DecodeError):
        return None


def health_detail(path: str, now: float | None = None) -> dict[str, dict[str, Any]]:
    """/health's detail of each service the launcher has down, by process name."""
    report = read_report(path)
    if report is None:
        return {}
    now = time.time() if now is None else now
    out: dict[str, dict[str, Any]] = {}
    for name, svc in report.services.items():
        if svc.state == RUNNING:
            continue
        entry: dict[str, Any] = {
            "state": svc.state,
            "cause": svc.cause,
            "down_seconds": round(max(0.0, now - svc.down_since), 1),
            "num_restarts": svc.num_restarts,
        }
        if svc.state == RESTARTING:
            entry["next_start_seconds"] = round(max(0.0, svc.next_start_at - now), 1)
        out[name] = entry
    return out


def metric_samples(path: str) -> list[MetricSample]:
    """``pdserve:service_restarts`` and ``pdserve:service_down`` of every supervised
    service, labelled as the services' own samples are (service, instance, rank)."""
    report = read_report(path)
    if report is None:
        return []
    out = []
    for name, svc in report.services.items():
        role, _, instance = name.partition("-")
        labels = {"service": role, "instance": instance or "0", "rank": "0"}
        out.append(MetricSample("pdserve:service_restarts", "counter", labels, svc.num_restarts))
        out.append(MetricSample("pdserve:service_down", "gauge", labels,
                                float(svc.state != RUNNING)))  # fmt: skip
    return out
