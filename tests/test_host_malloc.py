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


THREAD_CHILD = (
    "import resource, sys, threading, torch\n"
    "from pdserve.common.engine import host_malloc as h\n"
    "if sys.argv[1] == 'kept':\n"
    "    h.keep_freed_buffers()\n"
    "faults = []\n"
    "def step():  # a 2,048-token prefill's buffers, layer after layer\n"
    "    x = torch.ones(2048, 576)\n"
    "    for _ in range(8):\n"
    "        gate_up = torch.ones(2048, 3072)\n"
    "        act = gate_up[:, :1536] * gate_up[:, 1536:]\n"
    "        del gate_up\n"
    "        qkv = torch.ones(2048, 960)\n"
    "        x = x + act[:, :576] + qkv[:, :576]\n"
    "        del act, qkv\n"
    "def engine():\n"
    "    for _ in range(3):\n"
    "        step()\n"
    "    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt\n"
    "    for _ in range(5):\n"
    "        step()\n"
    "    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)\n"
    "t = threading.Thread(target=engine)\n"
    "t.start()\n"
    "t.join()\n"
    "print(faults[0])\n"
)


@pytest.mark.skipif(
    not (hasattr(os, "confstr") and os.confstr("CS_GNU_LIBC_VERSION")), reason="glibc"
)
def test_an_engine_threads_freed_buffers_are_reused_without_page_faults() -> None:
    """The services step their engine in a thread: glibc gives it an arena of its own whose
    64 MiB heaps cannot hold a step's buffers, so they were mmap'd and unmapped every step
    (a 2,048-token prefill faulted ~50k pages a step). One arena for all threads keeps them."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}

    def faults(mode: str) -> int:
        out = subprocess.run([sys.executable, "-c", THREAD_CHILD, mode], env=env,
                             capture_output=True, text=True, check=True, timeout=120)  # fmt: skip
        return int(out.stdout.strip())

    default, kept = faults("default"), faults("kept")
    assert default > 5_000, default  # the failure this guards against is real here
    assert kept < default // 20, (kept, default)


def test_engine_threads_of_cpu_services_apply_the_settings_before_they_start(monkeypatch) -> None:
    """Applied from inside the engine thread (its ModelRunner), the settings came after the
    thread had its own arena: the first large steps of a served CPU engine still faulted.
    So the thread's constructor, which runs on the service's main thread, applies them."""
    import asyncio

    from pdserve.common.runtime import engine_thread
    from pdserve.common.runtime.engine_thread import EngineContext, EngineThread
    from pdserve.common.runtime.metrics import Metrics
    from pdserve.common.runtime.service_config import DeploymentConfig

    calls: list[str] = []
    monkeypatch.setattr(engine_thread, "keep_freed_buffers", lambda: calls.append("kept"))
    loop = asyncio.new_event_loop()
    try:
        for device in ("cpu", "cuda"):
            ctx = EngineContext(cfg=DeploymentConfig(device=device), instance=0, torch_threads=1,
                                metrics=Metrics("decode", 0), reply=lambda *a: None)  # fmt: skip
            EngineThread(ctx, loop, f"engine-{device}")  # never started
            assert calls == ["kept"], device
    finally:
        loop.close()
