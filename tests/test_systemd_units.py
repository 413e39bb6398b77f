"""deploy/systemd: the unit files parse, pass ``systemd-analyze verify``, and start the
services with flags the CLI really takes."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

from pdserve.cli.main import build_parser
from pdserve.common.runtime.service_config import DeploymentConfig, load_config

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
UNITS = DEPLOY / "systemd"
SERVICES = ["pdserve-router.service", "pdserve-prefill@.service", "pdserve-decode@.service"]
INSTALLED = (
    "/opt/pdserve/.venv/bin/pdserve"  # a checkout at /opt/pdserve set up by scripts/setup.sh
)


def parse(name: str) -> dict[str, dict[str, list[str]]]:
    """A unit file as section -> key -> values (keys may repeat, as in systemd)."""
    sections: dict[str, dict[str, list[str]]] = {}
    current: dict[str, list[str]] = {}
    for raw in (UNITS / name).read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            current = sections.setdefault(line.strip("[]"), {})
            continue
        key, _, value = line.partition("=")
        current.setdefault(key.strip(), []).append(value.strip())
    return sections


def seconds(value: str) -> float:
    units = {"s": 1, "min": 60, "h": 3600}
    for suffix, factor in sorted(units.items(), key=lambda kv: -len(kv[0])):
        if value.endswith(suffix):
            return float(value[: -len(suffix)]) * factor
    return float(value)


@pytest.mark.parametrize("name", SERVICES)
def test_service_units_are_notify_services_that_drain(name: str) -> None:
    unit = parse(name)
    service = unit["Service"]
    assert service["Type"] == ["notify"]
    assert service["Restart"] == ["on-failure"]
    # Retried forever, as `pdserve up` retries (issue 40: a start limit gave up on a unit
    # whose port another process held); a configuration error is not retried.
    assert unit["Unit"]["StartLimitIntervalSec"] == ["0"]
    assert service["RestartPreventExitStatus"] == ["2"]
    assert seconds(service["WatchdogSec"][0]) > 0
    assert service["KillMode"] == ["mixed"]  # SIGTERM to the service, which stops its ranks
    # systemd must not SIGKILL a drain that is within its configured time.
    assert seconds(service["TimeoutStopSec"][0]) >= DeploymentConfig().drain_seconds + 15
    env_files = service["EnvironmentFile"]
    assert "-/etc/pdserve/pdserve.env" in env_files and len(env_files) == 2
    assert unit["Unit"]["PartOf"] == ["pdserve.target"]
    assert unit["Install"]["WantedBy"] == ["pdserve.target"]
    if name != "pdserve-router.service":
        assert service["LimitMEMLOCK"] == ["infinity"]  # NIXL pins the KV cache
        assert any("%i" in f for f in env_files)


@pytest.mark.parametrize("name", SERVICES)
def test_exec_start_uses_flags_the_cli_takes(name: str) -> None:
    argv = shlex.split(parse(name)["Service"]["ExecStart"][0].replace("%i", "3"))
    assert argv[0] == INSTALLED
    args = build_parser().parse_args(argv[1:])
    assert args.role == name.removeprefix("pdserve-").split("@")[0].split(".")[0]
    assert args.config == "/etc/pdserve/deploy.toml"
    if "@" in name:
        assert args.instance == 3


def test_systemd_analyze_verify(tmp_path: Path) -> None:
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed (apt-get install systemd)")
    # verify checks that ExecStart's program exists: point it at a stand-in.
    program = tmp_path / "pdserve"
    program.write_text("#!/bin/sh\nexit 0\n")
    program.chmod(0o755)
    for unit in UNITS.iterdir():
        text = unit.read_text().replace(INSTALLED, str(program))
        text = text.replace("/usr/bin/nvidia-cuda-mps-control", str(program))  # no driver here
        (tmp_path / unit.name).write_text(text)
    names = [
        "pdserve.target",
        "pdserve-router.service",
        "pdserve-prefill@0.service",
        "pdserve-decode@1.service",
        "pdserve-mps.service",
    ]
    done = subprocess.run([analyze, "verify", "--man=no", *names], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120, check=False)  # fmt: skip
    # Unknown keys and unparsable values are only warnings: any line naming our units fails.
    complaints = [line for line in (done.stdout + done.stderr).splitlines() if "pdserve" in line]
    assert done.returncode == 0 and not complaints, done.stdout + done.stderr


def test_the_example_config_is_a_valid_two_machine_deployment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for key in [k for k in os.environ if k.startswith("PDSERVE_")]:
        monkeypatch.delenv(key)
    cfg = load_config(DEPLOY / "deploy.example.toml")
    assert [a.address for a in cfg.prefill_addresses] == ["tcp://10.0.0.1:5610"]
    assert [a.address for a in cfg.decode_addresses] == [
        "tcp://10.0.0.2:5620",
        "tcp://10.0.0.2:5630",
    ]
    assert cfg.front_address == "tcp://10.0.0.1:5600"
    timeout_stop = min(seconds(parse(name)["Service"]["TimeoutStopSec"][0]) for name in SERVICES)
    assert cfg.drain_seconds + 15 <= timeout_stop


def test_the_mps_daemon_unit_runs_before_the_engines_with_their_pipe_directory() -> None:
    """deploy/systemd/pdserve-mps.service (docs/operations.md, "Both roles on one GPU"):
    the daemon the prefill and decode units of a one-GPU machine share, started before
    them, its pipe directory the one the docs tell the units to name."""
    unit = parse("pdserve-mps.service")
    service = unit["Service"]
    assert service["Type"] == ["forking"] and service["User"] == ["pdserve"]
    assert service["ExecStart"] == ["/usr/bin/nvidia-cuda-mps-control -d"]
    assert "quit" in service["ExecStop"][0]
    env = dict(item.split("=", 1) for item in service["Environment"][0].split())
    assert env["CUDA_MPS_PIPE_DIRECTORY"] == "/run/" + service["RuntimeDirectory"][0]
    for name in ("pdserve-prefill@.service", "pdserve-decode@.service"):
        assert "pdserve-mps.service" in parse(name)["Unit"]["After"][0].split()
    docs = (UNITS.parents[1] / "docs" / "operations.md").read_text()
    assert f"CUDA_MPS_PIPE_DIRECTORY={env['CUDA_MPS_PIPE_DIRECTORY']}" in docs
