"""What made a results file: the git commit of the code (``-dirty`` when the tree had
uncommitted changes), the exact command line, and the ``PDSERVE_*`` environment variables
set (they change a run as a flag does; a secret's name is kept, its value is not). Every
results JSON records them.

A copy of the tree without ``.git`` (the GPU machine gets one) names its commit in
``PDSERVE_GIT_COMMIT`` (benchmarks/gpu.sh passes it on); else it is "unknown".
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

COMMIT_ENV = "PDSERVE_GIT_COMMIT"
_command: list[str] | None = None  # set by cli/main.py when called with an argv (tests)


def record_command(argv: list[str]) -> None:
    global _command
    _command = list(argv)


def git_commit() -> str:
    if os.environ.get(COMMIT_ENV):
        return os.environ[COMMIT_ENV]
    here = Path(__file__).resolve().parent
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, timeout=10
        )
        if out.returncode != 0:
            return "unknown"
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=here,
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):  # no git on this machine
        return "unknown"
    return out.stdout.strip() + ("-dirty" if dirty else "")


def command_line() -> str:
    """The command as typed: ``pdserve ...`` for the CLI (``python -m pdserve`` and
    ``main(argv)`` included), ``python script.py ...`` for a script."""
    if _command is not None:
        return shlex.join(_command)
    argv = sys.argv
    if not argv:
        return ""
    first = Path(argv[0])
    if first.suffix == ".py" and first.name != "__main__.py":
        return shlex.join(["python", *argv])
    return shlex.join(["pdserve", *argv[1:]])


# a name with one of these words (between underscores) holds a secret: PDSERVE_API_KEY,
# not PDSERVE_ENGINE__MAX_NUM_BATCHED_TOKENS
SECRET_WORDS = {"KEY", "KEYS", "SECRET", "TOKEN", "PASSWORD"}


def environment() -> dict[str, str]:
    """The ``PDSERVE_*`` variables of this run (``PDSERVE_GIT_COMMIT`` aside: it is the
    commit), a secret's value replaced by ``<set>``."""
    return {
        name: "<set>" if SECRET_WORDS & set(name.split("_")) else value
        for name, value in sorted(os.environ.items())
        if name.startswith("PDSERVE_") and name != COMMIT_ENV
    }


def provenance() -> dict[str, object]:
    """``{"git_commit", "command", "environment"}`` for a results JSON."""
    return {"git_commit": git_commit(), "command": command_line(), "environment": environment()}
