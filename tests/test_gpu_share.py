"""Both roles on one GPU (cli/gpu_share.py): the --gpu-share flag, each role's environment,
the CUDA MPS control daemon found, started and stopped (a fake nvidia-cuda-mps-control on
PATH that keeps its state in its pipe directory as the real one does), and the refusals."""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any

import pytest

from pdserve.cli.gpu_share import GpuShare, parse_gpu_share, plan, start_mps
from pdserve.common.errors import PdserveError

# The real daemon: `-d` forks a daemon listening on $CUDA_MPS_PIPE_DIRECTORY/control;
# commands come on stdin (get_server_list, quit). This one records each call.
FAKE_CONTROL = """#!/bin/sh
pipe="${CUDA_MPS_PIPE_DIRECTORY:-/tmp/nvidia-mps}"
echo "$* pipe=$pipe log=${CUDA_MPS_LOG_DIRECTORY:-}" >> "$FAKE_MPS_CALLS"
if [ "$1" = "-d" ]; then
    [ -n "$FAKE_MPS_FAIL" ] && { echo "An instance of this daemon is already running" >&2; exit 1; }
    : > "$pipe/control"; exit 0
fi
[ -e "$pipe/control" ] || { echo "Cannot find MPS control daemon process" >&2; exit 1; }
read -r cmd
echo "stdin=$cmd" >> "$FAKE_MPS_CALLS"
[ "$cmd" = quit ] && rm -f "$pipe/control"
exit 0
"""


@pytest.fixture
def fake_mps(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fake control binary first on PATH; returns the file its calls are recorded in."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    control = bin_dir / "nvidia-cuda-mps-control"
    control.write_text(FAKE_CONTROL)
    control.chmod(control.stat().st_mode | stat.S_IXUSR)
    calls = tmp_path / "calls.txt"
    calls.touch()
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_MPS_CALLS", str(calls))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    monkeypatch.delenv("CUDA_MPS_PIPE_DIRECTORY", raising=False)
    return calls


def test_the_flag_parses_a_split_and_refuses_by_name() -> None:
    assert parse_gpu_share("auto") == GpuShare("auto")
    assert parse_gpu_share("off") == GpuShare("off")
    assert parse_gpu_share("decode=40,prefill=60") == GpuShare("split", 60, 40)
    for bad, why in [
        ("prefill=60", "gives no share for decode"),
        ("prefill=0,decode=40", "1..100"),
        ("prefill=101,decode=40", "1..100"),
        ("prefill=6x,decode=40", "a whole percent"),
        ("prefill=60,decode=40,router=5", "auto, off or prefill=P,decode=D"),
        ("prefill=60,prefill=40", "names prefill twice"),
        ("half", "auto, off or prefill=P,decode=D"),
    ]:
        with pytest.raises(ValueError, match=why):
            parse_gpu_share(bad)


def test_each_role_gets_its_share_of_the_sms() -> None:
    assert GpuShare("split", 60, 40).role_env() == {
        "prefill": {"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "60"},
        "decode": {"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "40"},
    }
    assert GpuShare("split", 100, 40).role_env() == {
        "decode": {"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "40"}  # 100: no limit, no variable
    }
    assert GpuShare("auto").role_env() == {}


def test_where_mps_applies_and_the_refusals(
    fake_mps: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    env = dict(os.environ)
    split = GpuShare("split", 60, 40)
    assert plan(GpuShare("auto"), "cuda", False, env) == (True, None)
    assert plan(split, "cuda", False, env) == (True, None)
    assert plan(GpuShare("off"), "cuda", False, env) == (False, None)
    # nothing to share: auto does nothing, an explicit split is refused, naming why
    for device, colocated, gpus, why in [
        ("cpu", False, "0", "runs on cpu, not cuda"),
        ("cuda", True, "0", "a colocated deployment has one GPU process"),
        ("cuda", False, "0,1", "2 GPUs are visible"),
    ]:
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": gpus}
        assert plan(GpuShare("auto"), device, colocated, env) == (False, None)
        with pytest.raises(PdserveError, match=why):
            plan(split, device, colocated, env)
    # one GPU without the MPS tools: auto says the roles time-slice; a split is refused
    env = {**os.environ, "PATH": "/nonexistent"}
    use, note = plan(GpuShare("auto"), "cuda", False, env)
    assert not use and note is not None and "time-sliced" in note
    with pytest.raises(PdserveError, match="nvidia-cuda-mps-control is not on PATH"):
        plan(split, "cuda", False, env)
    with pytest.raises(PdserveError, match="CUDA MPS is not available.*--gpu-share off"):
        start_mps(Path("/tmp"), env)


def test_a_daemon_is_started_under_the_runtime_dir_and_stopped(fake_mps: Path,
                                                               tmp_path: Path) -> None:  # fmt: skip
    runtime = tmp_path / "run"
    daemon = start_mps(runtime, dict(os.environ))
    assert daemon.started and daemon.pipe_dir == runtime / "mps-pipe"
    assert (runtime / "mps-pipe" / "control").exists() and (runtime / "mps-log").is_dir()
    assert daemon.env == {"CUDA_MPS_PIPE_DIRECTORY": str(runtime / "mps-pipe"),
                          "CUDA_MPS_LOG_DIRECTORY": str(runtime / "mps-log")}  # fmt: skip
    calls = fake_mps.read_text().splitlines()
    assert calls[0] == f"-d pipe={runtime / 'mps-pipe'} log={runtime / 'mps-log'}"
    daemon.stop()
    assert not (runtime / "mps-pipe" / "control").exists()
    assert "stdin=quit" in fake_mps.read_text().splitlines()
    daemon.stop()  # once only
    assert fake_mps.read_text().count("stdin=quit") == 1


def test_a_running_daemon_is_used_and_left_running(fake_mps: Path, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    pipe = tmp_path / "system-mps"
    pipe.mkdir()
    (pipe / "control").touch()  # the system's daemon (its systemd unit)
    monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", str(pipe))
    daemon = start_mps(tmp_path / "run", dict(os.environ))
    assert not daemon.started and daemon.env == {"CUDA_MPS_PIPE_DIRECTORY": str(pipe)}
    daemon.stop()
    assert (pipe / "control").exists() and "quit" not in fake_mps.read_text()
    assert "-d" not in fake_mps.read_text()
    # the variable naming a directory no daemon listens on: refused, not a second daemon
    (pipe / "control").unlink()
    with pytest.raises(PdserveError, match="names no running MPS control daemon"):
        start_mps(tmp_path / "run", dict(os.environ))


def test_a_daemon_that_cannot_start_is_reported(fake_mps: Path, tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    monkeypatch.setenv("FAKE_MPS_FAIL", "1")
    with pytest.raises(PdserveError, match="exited with 1: An instance of this daemon"):
        start_mps(tmp_path / "run", dict(os.environ))


class FakeProc:
    def __init__(self) -> None:
        self.pid, self.returncode = 4242, None

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        self.returncode = 0
        return 0

    def send_signal(self, sig: int) -> None:
        self.returncode = 0

    def kill(self) -> None:
        self.returncode = -9


def test_pdserve_up_gives_each_role_its_env_and_stops_the_daemon_it_started(
    fake_mps: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The launcher's side (cli/deployment.py) with its process spawner replaced: the env
    each service is started with, and the daemon quit after them."""
    from pdserve.cli import deployment as dep_mod

    spawned: dict[str, dict[str, str]] = {}

    class Spawner:
        def spawn(self, name: str, args: list[str], env: dict[str, str], *rest: Any) -> FakeProc:
            spawned[name] = env
            return FakeProc()

    monkeypatch.setattr(dep_mod, "zygote_for", lambda env: Spawner())
    cfg = dep_mod.local_config(device="cuda", base_port=47000, http_port=47099)
    dep = dep_mod.Deployment(cfg, tmp_path / "logs", gpu_share=GpuShare("split", 70, 30))
    dep.start()
    pipe = str(tmp_path / "logs" / "mps-pipe")
    assert spawned["prefill-0"]["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "70"
    assert spawned["decode-0"]["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "30"
    assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE" not in spawned["router"]
    assert all(env["CUDA_MPS_PIPE_DIRECTORY"] == pipe for env in spawned.values())
    assert "stdin=quit" not in fake_mps.read_text()
    dep.stop(timeout=1)
    assert "stdin=quit" in fake_mps.read_text() and dep.mps is None
    # --gpu-share off: no daemon, no variables
    spawned.clear()
    dep = dep_mod.Deployment(cfg, tmp_path / "logs2", gpu_share=GpuShare("off"))
    dep.start()
    assert not any(k.startswith("CUDA_MPS") for env in spawned.values() for k in env)
    dep.stop(timeout=1)


def test_the_flag_reaches_up_and_bench_serve(capsys: pytest.CaptureFixture[str]) -> None:
    from pdserve.cli.main import main

    with pytest.raises(SystemExit):
        main(["up", "--gpu-share", "prefill=60"])
    assert "gives no share for decode" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["bench", "serve", "--compare", "--gpu-share", "prefill=60,decode=200"])
    assert "1..100" in capsys.readouterr().err


def test_a_deployment_whose_split_cannot_apply_starts_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--gpu-share prefill=60,decode=40 on a CPU deployment: refused before any process
    starts, and the keys the start made are gone."""
    from pdserve.cli import deployment as dep_mod

    monkeypatch.setattr(dep_mod, "zygote_for", lambda env: pytest.fail("a process started"))
    cfg = dep_mod.local_config(device="cpu", base_port=47200, http_port=47299)
    dep = dep_mod.Deployment(cfg, tmp_path / "logs", gpu_share=GpuShare("split", 60, 40))
    with pytest.raises(PdserveError, match="needs CUDA MPS on one GPU: the deployment runs on cpu"):
        dep.start()
    assert dep.made_keys is None and not dep.procs


@pytest.mark.gpu
def test_a_real_mps_daemon_serves_a_cuda_process_held_to_its_share(tmp_path: Path) -> None:
    """On a GPU machine: the daemon found or started (start_mps), a CUDA process of a role
    with its share of the SMs runs under it (a server appears for it), the daemon quit
    after when this test started it. Nothing CUDA in this process."""
    import shutil
    import subprocess
    import sys

    from pdserve.cli.gpu_share import visible_gpus

    if not visible_gpus(dict(os.environ)) or shutil.which("nvidia-cuda-mps-control") is None:
        pytest.skip("needs a GPU and nvidia-cuda-mps-control")
    daemon = start_mps(tmp_path, dict(os.environ))
    env = {**os.environ, **daemon.env}
    try:
        code = ("import torch; x = torch.ones(1 << 20, device='cuda'); "
                "print(int(x.sum().item()), torch.cuda.get_device_properties(0).multi_processor_count)")  # fmt: skip
        run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             timeout=300, env={**env, "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "50"})  # fmt: skip
        assert run.returncode == 0, run.stderr[-2000:]
        assert run.stdout.split()[0] == str(1 << 20)
        servers = subprocess.run([daemon.control], input="get_server_list\n", text=True,
                                 capture_output=True, env=env, timeout=30)  # fmt: skip
        assert servers.returncode == 0 and servers.stdout.strip(), servers.stderr
    finally:
        daemon.stop()
