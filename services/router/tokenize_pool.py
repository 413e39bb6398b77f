"""Tokenise and render large prompts in worker processes, never on the router's loop.

``tokenizers``' encode holds the GIL for its whole run: from a thread
(``asyncio.to_thread``) a 10 MB prompt still froze the loop for seconds, pings went
unanswered and healthy peers were declared down. A worker process has its own GIL (and
its own memory: the worker that tokenised a huge prompt is replaced after
``MAX_TASKS_PER_CHILD`` tasks, so the memory goes back to the system).

``run(fn, arg)`` calls ``fn(core, arg)`` in a worker, where ``core`` has the one
attribute the front ends' tokenising functions use, ``tokenizer``; ``fn`` and ``arg``
must pickle (module-level functions, msgspec Structs, plain data), and so must what it
raises (``RequestError``; the HTTP API's ``ApiError`` pickles too).
"""

from __future__ import annotations

import asyncio
import multiprocessing
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from pdserve.common.model.tokenizer import Tokenizer
from pdserve.common.runtime.parent_watch import exit_with_parent

T = TypeVar("T")

MAX_TASKS_PER_CHILD = 16


@dataclass
class _WorkerCore:
    tokenizer: Tokenizer


_core: _WorkerCore | None = None


def _init(model_dir: str) -> None:
    global _core
    exit_with_parent()  # a killed router's worker would wait on its queue forever
    _core = _WorkerCore(Tokenizer.from_dir(model_dir))


def _call(fn: Callable[[Any, Any], T], arg: Any) -> T:
    assert _core is not None, "the worker was not initialised"
    return fn(_core, arg)


def _ready(_: object, __: object) -> bool:
    return True


class TokenizePool:
    def __init__(self, model_dir: str | Path, workers: int = 1) -> None:
        self._pool = ProcessPoolExecutor(
            max_workers=workers,
            mp_context=multiprocessing.get_context("spawn"),
            initializer=_init,
            initargs=(str(model_dir),),
            max_tasks_per_child=MAX_TASKS_PER_CHILD,
        )

    async def start(self) -> None:
        """Start a worker now (its tokenizer loaded), not on the first large prompt."""
        await self.run(_ready, None)

    async def run(self, fn: Callable[[Any, Any], T], arg: Any) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, _call, fn, arg)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
