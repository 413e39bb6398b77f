"""What made a results file: the git commit of the code and the exact command line."""

from __future__ import annotations

import shlex
import subprocess
import sys
from pathlib import Path

# A copy of the tree without .git (the GPU machine gets one) names its commit here.
COMMIT_ENV = "PDSERVE_GIT_COMMIT"


def git_commit() -> str:
    import os

    if os.environ.get(COMMIT_ENV):
        return os.environ[COMMIT_ENV]
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            cwd=Path(__file__).resolve().parent,
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    if out.returncode != 0:
        return "unknown"
    dirty = subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=no"],
        cwd=Path(__file__).resolve().parent,
        capture_output=True,
        text=True,
        timeout=10,
    ).stdout.strip()
    return out.stdout.strip() + ("-dirty" if dirty else "")


def provenance() -> dict[str, str]:
    """``{"git_commit", "command"}`` for a results JSON."""
    command = shlex.join(["pdserve", *sys.argv[1:]]) if sys.argv else ""
    return {"git_commit": git_commit(), "command": command}
