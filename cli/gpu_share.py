"""Both roles on one GPU without time-slicing: CUDA MPS for ``pdserve up`` (``--gpu-share``).

A prefill and a decode process on one GPU, each with its own CUDA context, are
time-sliced by the driver: one runs its kernels while the other waits, so a disaggregated
deployment on one card loses to a colocated one (issue #48). Under CUDA MPS (the
Multi-Process Service) their kernels run at the same time on the GPU's SMs, and each may be
held to a share of them (``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE``, read when the process
creates its context).

``--gpu-share`` says what ``pdserve up`` (and ``bench serve --compare``) does:

- ``auto`` (the default): on a CUDA deployment with prefill and decode processes and one
  visible GPU, use MPS: a control daemon already running (its pipe directory,
  ``CUDA_MPS_PIPE_DIRECTORY`` or ``/tmp/nvidia-mps``), else one started for the deployment
  (``nvidia-cuda-mps-control -d``, its pipe and log directories under the deployment's log
  directory, stopped when the deployment stops); no per-role limit. Elsewhere (CPU,
  colocated, several GPUs, no MPS tools) nothing, with a note where one GPU is left to
  time-slicing;
- ``off``: nothing;
- ``prefill=P,decode=D`` (percent of the SMs, 1..100 each; they may add up to more than
  100): as ``auto``, and each role's processes get ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE``;
  refused, naming why, where MPS cannot be used.

The issue's measurement on one H100 (MPS with no per-role limit) gave the disaggregated
deployment 1.1x colocated's goodput; which split is best is for the GPU suite
(``benchmarks/gpu.sh pd-one-gpu``) to say: the default takes no split until it does.
docs/operations.md ("Both roles on one GPU") has the systemd unit for the daemon.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from pdserve.common.errors import PdserveError

CONTROL = "nvidia-cuda-mps-control"
DEFAULT_PIPE_DIR = "/tmp/nvidia-mps"
START_TIMEOUT_S = 10.0
ROLES = ("prefill", "decode")


@dataclass(frozen=True)
class GpuShare:
    """What ``--gpu-share`` asked for: ``mode`` auto / off / split, and with split each
    role's percentage of the SMs."""

    mode: str = "auto"
    prefill: int = 100
    decode: int = 100

    def role_env(self) -> dict[str, dict[str, str]]:
        """Each role's CUDA_MPS_ACTIVE_THREAD_PERCENTAGE (none at 100: no limit)."""
        if self.mode != "split":
            return {}
        return {
            role: {"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": str(pct)}
            for role, pct in (("prefill", self.prefill), ("decode", self.decode))
            if pct < 100
        }

    def describe(self) -> str:
        if self.mode == "split":
            return f"prefill {self.prefill}% / decode {self.decode}% of the SMs"
        return "no per-role limit"


def parse_gpu_share(text: str) -> GpuShare:
    """``auto``, ``off`` or ``prefill=P,decode=D`` (argparse's type: ValueError names the
    problem)."""
    text = text.strip()
    if text in ("auto", "off"):
        return GpuShare(mode=text)
    shares: dict[str, int] = {}
    for part in text.split(","):
        role, sep, value = part.partition("=")
        role = role.strip()
        if not sep or role not in ROLES:
            raise ValueError(
                f"--gpu-share takes auto, off or prefill=P,decode=D (percent), got {text!r}"
            )
        if role in shares:
            raise ValueError(f"--gpu-share names {role} twice: {text!r}")
        try:
            pct = int(value)
        except ValueError:
            raise ValueError(f"--gpu-share {role}={value!r}: a whole percent, 1..100") from None
        if not 1 <= pct <= 100:
            raise ValueError(f"--gpu-share {role}={pct}: a percent of the SMs is 1..100")
        shares[role] = pct
    missing = [r for r in ROLES if r not in shares]
    if missing:
        raise ValueError(f"--gpu-share {text!r} gives no share for {', '.join(missing)}")
    return GpuShare(mode="split", prefill=shares["prefill"], decode=shares["decode"])


def visible_gpus(env: dict[str, str]) -> int | None:
    """GPUs the services would see: CUDA_VISIBLE_DEVICES when set, else ``nvidia-smi -L``
    (the launcher creates no CUDA context of its own); None when neither says."""
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([d for d in visible.split(",") if d.strip() and d.strip() != "-1"])
    smi = shutil.which("nvidia-smi", path=env.get("PATH"))
    if smi is None:
        return None
    try:
        out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=20, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return len([line for line in out.stdout.splitlines() if line.startswith("GPU ")])


class MpsDaemon:
    """The MPS control daemon a deployment uses: one found running, or one it started
    (then stopped with it). ``env``: what the services need to reach it (its pipe
    directory when not the default)."""

    def __init__(self, control: str, pipe_dir: Path, log_dir: Path | None, started: bool) -> None:
        self.control, self.pipe_dir, self.log_dir = control, pipe_dir, log_dir
        self.started = started

    @property
    def env(self) -> dict[str, str]:
        out = {"CUDA_MPS_PIPE_DIRECTORY": str(self.pipe_dir)}
        if self.log_dir is not None:
            out["CUDA_MPS_LOG_DIRECTORY"] = str(self.log_dir)
        return out

    def stop(self) -> None:
        """Quit the daemon if this deployment started it (``echo quit | control``)."""
        if not self.started:
            return
        self.started = False
        try:
            subprocess.run([self.control], input="quit\n", text=True, capture_output=True,
                           env={**os.environ, **self.env}, timeout=30)  # fmt: skip
        except (OSError, subprocess.SubprocessError):
            pass


def _answers(control: str, pipe_dir: Path) -> bool:
    """A daemon listens on ``pipe_dir``: its control pipe is there and it answers."""
    if not (pipe_dir / "control").exists():
        return False
    env = {**os.environ, "CUDA_MPS_PIPE_DIRECTORY": str(pipe_dir)}
    try:
        done = subprocess.run([control], input="get_server_list\n", text=True,
                              capture_output=True, env=env, timeout=10)  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return False
    return done.returncode == 0


def start_mps(runtime_dir: Path, env: dict[str, str]) -> MpsDaemon:
    """The running daemon (``CUDA_MPS_PIPE_DIRECTORY`` or the default pipe directory), else
    one started with its pipe and log directories under ``runtime_dir``."""
    control = shutil.which(CONTROL, path=env.get("PATH"))
    if control is None:
        raise PdserveError(
            f"CUDA MPS is not available: {CONTROL} is not on PATH (it comes with the NVIDIA "
            "driver's utilities); without it prefill and decode time-slice the GPU. Install "
            "it, or pass --gpu-share off"
        )
    pipe = Path(env.get("CUDA_MPS_PIPE_DIRECTORY") or DEFAULT_PIPE_DIR)
    if _answers(control, pipe):
        return MpsDaemon(control, pipe, None, started=False)
    if env.get("CUDA_MPS_PIPE_DIRECTORY"):
        raise PdserveError(
            f"CUDA_MPS_PIPE_DIRECTORY={pipe} names no running MPS control daemon; start it "
            f"(`{CONTROL} -d` with that variable set, or its systemd unit, "
            "docs/operations.md) or unset the variable"
        )
    pipe, logs = runtime_dir / "mps-pipe", runtime_dir / "mps-log"
    pipe.mkdir(parents=True, exist_ok=True)
    logs.mkdir(parents=True, exist_ok=True)
    daemon = MpsDaemon(control, pipe, logs, started=True)
    try:
        done = subprocess.run([control, "-d"], capture_output=True, text=True,
                              env={**env, **daemon.env}, timeout=30)  # fmt: skip
    except (OSError, subprocess.SubprocessError) as exc:
        raise PdserveError(f"starting the CUDA MPS control daemon failed: {exc}") from exc
    if done.returncode != 0:
        raise PdserveError(
            f"`{CONTROL} -d` exited with {done.returncode}: "
            f"{(done.stderr or done.stdout).strip()[:300]} (its log: {logs})"
        )
    deadline = time.monotonic() + START_TIMEOUT_S
    while not _answers(control, pipe):
        if time.monotonic() > deadline:
            daemon.stop()
            raise PdserveError(
                f"the CUDA MPS control daemon did not answer on {pipe} within "
                f"{START_TIMEOUT_S:.0f} s (its log: {logs})"
            )
        time.sleep(0.1)
    return daemon


def plan(share: GpuShare, device: str, colocated: bool,
         env: dict[str, str]) -> tuple[bool, str | None]:  # fmt: skip
    """Whether MPS is used for this deployment, and a note for stderr (why not, where one
    GPU is left to time-slicing). Refuses an explicit split that cannot apply."""
    if share.mode == "off":
        return False, None
    why = None
    if device != "cuda":
        why = f"the deployment runs on {device}, not cuda"
    elif colocated:
        why = "a colocated deployment has one GPU process"
    else:
        gpus = visible_gpus(env)
        if gpus is not None and gpus != 1:
            why = f"{gpus} GPUs are visible (MPS splits one)"
        elif shutil.which(CONTROL, path=env.get("PATH")) is None:
            why = f"{CONTROL} is not on PATH"
            if share.mode == "auto":
                return False, (
                    f"note: prefill and decode share the GPU time-sliced ({why}; "
                    "docs/operations.md, 'Both roles on one GPU')"
                )
    if why is None:
        return True, None
    if share.mode == "split":
        raise PdserveError(f"--gpu-share {share.describe()} needs CUDA MPS on one GPU: {why}")
    return False, None
