"""common/engine/host_malloc.py: glibc's mallopt is called once per process, never over
the environment's own MALLOC_* settings (run in a child so this process keeps its own)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

CHILD = (
    "from pdserve.common.engine import host_malloc as h\n"
    "first = h.keep_freed_buffers()\n"
    "print(first, h.keep_freed_buffers() == first)\n"
)


def _run(env: dict[str, str]) -> str:
    out = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True,
                         text=True, check=True, timeout=60)  # fmt: skip
    return out.stdout.strip()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc mallopt")
def test_applied_once_unless_the_environment_sets_malloc() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    glibc = os.confstr("CS_GNU_LIBC_VERSION") if hasattr(os, "confstr") else None
    assert _run(env) == ("True True" if glibc else "False True")
    assert _run({**env, "MALLOC_TRIM_THRESHOLD_": "131072"}) == "False True"
