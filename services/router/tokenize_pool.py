"""Tokenise and render long prompts in worker processes of the router's own, never on its loop.

``tokenizers``' encode holds the GIL for its whole run: from a thread
(``asyncio.to_thread``) a 10 MB prompt still froze the loop for seconds, pings went
unanswered and healthy peers were declared down. A worker process has its own GIL.

The workers are processes this pool owns, not a ``ProcessPoolExecutor``: that pool's
``max_tasks_per_child`` (to give a huge prompt's memory back) deadlocks on CPython 3.11
when it replaces a worker (gh-115634), and then every long prompt hung with no answer
while short ones and /health stayed fine. Here each worker takes one job at a time over
a pipe, and the pool watches it:

- every job has a deadline (``timeout``, from the moment it was submitted, its wait for
  a worker included): past it the job fails ``TokenizeFailed("timeout")``, and a worker
  still running it is killed and replaced, so nothing stuck holds the jobs behind it;
- a worker that dies (a bug, the OOM killer) fails only the job it held, and is replaced;
- a worker that grew past ``RECYCLE_RSS_BYTES`` (a huge prompt's memory) is replaced
  between jobs, so the memory goes back to the system;
- at most ``max_waiting`` jobs wait: beyond, ``TokenizeFailed("overloaded")``.

``run(fn, arg)`` calls ``fn(core, arg)`` in a worker, where ``core`` has the one
attribute the front ends' tokenising functions use, ``tokenizer``; ``fn`` and ``arg``
must pickle (module-level functions, msgspec Structs, plain data), and so must what it
raises (``RequestError``; the HTTP API's ``ApiError`` pickles too).
"""

from __future__ import annotations

import asyncio
import collections
import multiprocessing
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, TypeVar

import structlog

from pdserve.common.runtime.log_throttle import LogThrottle
from pdserve.services.router.core_api import Refused

T = TypeVar("T")

log = structlog.get_logger("pdserve.router.tokenize")

RECYCLE_RSS_BYTES = 1 << 30  # a worker this large is replaced after its job
DEFAULT_TIMEOUT = 30.0


class TokenizeFailed(Refused):
    """A job the pool could not do: ``reason`` is "timeout", "overloaded", "draining" or
    "internal" (the worker died), as a Failed's reason."""


@dataclass
class _WorkerCore:
    tokenizer: Any


def _worker_main(model_dir: str, conn: Connection) -> None:
    """A worker: load the tokenizer, then answer jobs until the pipe closes."""
    from pdserve.common.model.checkpoint.tokenizer import Tokenizer
    from pdserve.common.runtime.parent_watch import exit_with_parent

    exit_with_parent()  # a killed router's worker would wait on its pipe forever
    core = _WorkerCore(Tokenizer.from_dir(model_dir))
    while True:
        try:
            fn, arg = conn.recv()
        except (EOFError, OSError):
            return
        try:
            answer: tuple[str, Any] = ("ok", fn(core, arg))
        except Exception as exc:  # noqa: BLE001 - handed to the caller, which answers it
            answer = ("error", exc)
        try:
            conn.send((*answer, _rss()))
        except Exception as exc:  # noqa: BLE001 - an exception that does not pickle
            conn.send(("error", RuntimeError(f"{type(exc).__name__}: {exc}"), _rss()))


def _rss() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):  # not Linux: never recycled for its size
        return 0


def _ready(_: object, __: object) -> bool:
    return True


class _Worker:
    """One worker process and the parent's end of its pipe; used from one thread at a time."""

    def __init__(self, model_dir: str) -> None:
        ctx = multiprocessing.get_context("spawn")  # no copy of the router's loop and sockets
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_worker_main, args=(model_dir, child), daemon=True,
                                   name="pdserve-tokenize")  # fmt: skip
        self.process.start()
        child.close()

    def call(self, fn: Callable[[Any, Any], Any], arg: Any, timeout: float) -> tuple[str, Any, int]:
        """Blocking: ("ok", value, rss), ("error", exception, rss), ("timeout", None, 0) or
        ("died", exit code, 0)."""
        try:
            self.conn.send((fn, arg))
            if not self.conn.poll(timeout):
                return ("timeout", None, 0)
            status, value, rss = self.conn.recv()
            return (status, value, rss)
        except (EOFError, OSError):
            self.process.join(1.0)
            return ("died", self.process.exitcode, 0)

    def stop(self) -> None:
        self.conn.close()
        if self.process.is_alive():
            self.process.kill()
        self.process.join(2.0)


@dataclass
class _Job:
    fn: Callable[[Any, Any], Any]
    arg: Any
    deadline: float  # time.monotonic()
    future: asyncio.Future[Any] = field(repr=False)


class TokenizePool:
    def __init__(self, model_dir: str | Path, workers: int = 1, timeout: float = DEFAULT_TIMEOUT,
                 max_waiting: int = 1024) -> None:  # fmt: skip
        """``timeout``: a job's deadline in seconds from its submission
        (``tokenize_timeout_seconds``); ``max_waiting``: jobs queued at most."""
        self.model_dir = str(model_dir)
        self.timeout = timeout
        self.max_waiting = max_waiting
        self._workers: list[_Worker | None] = [None] * workers
        # Blocking pipe I/O of each worker runs on a thread of its own (the loop never waits).
        self._threads = ThreadPoolExecutor(workers, thread_name_prefix="pdserve-tokenize")
        self._jobs: collections.deque[_Job] = collections.deque()
        self._wakeup: asyncio.Event | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self.num_replaced = 0  # workers killed or lost and started again (tests, logs)
        self.throttle = LogThrottle()  # a burst of timeouts: one line per interval

    async def start(self) -> None:
        """Start the workers now (their tokenizers loaded), not on the first long prompt."""
        self._wakeup = asyncio.Event()
        self._tasks = [asyncio.create_task(self._serve(i)) for i in range(len(self._workers))]
        await asyncio.gather(*(self.run(_ready, None) for _ in self._workers))

    def worker_pids(self) -> list[int]:
        return [w.process.pid for w in self._workers if w is not None and w.process.pid]

    async def run(self, fn: Callable[[Any, Any], T], arg: Any) -> T:
        """``fn(core, arg)`` in a worker; TokenizeFailed past the deadline or the bound."""
        if self._wakeup is None:
            raise RuntimeError("TokenizePool.start() was not awaited")
        if len(self._jobs) >= self.max_waiting:
            raise TokenizeFailed("overloaded", f"{len(self._jobs)} prompts wait to be "
                                 "tokenised, the router's limit; retry later")  # fmt: skip
        job = _Job(fn, arg, time.monotonic() + self.timeout,
                   asyncio.get_running_loop().create_future())  # fmt: skip
        self._jobs.append(job)
        self._wakeup.set()
        return await job.future

    async def _serve(self, index: int) -> None:
        assert self._wakeup is not None
        loop = asyncio.get_running_loop()
        while True:
            if not self._jobs:
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            job = self._jobs.popleft()
            if job.future.done():  # its caller left (client gone)
                continue
            remaining = job.deadline - time.monotonic()
            if remaining <= 0:
                self._timed_out(job, waited=True)
                continue
            worker = self._workers[index]
            try:
                if worker is None:
                    worker = await loop.run_in_executor(self._threads, _Worker, self.model_dir)
                    self._workers[index] = worker
                status, value, rss = await loop.run_in_executor(
                    self._threads, worker.call, job.fn, job.arg, remaining
                )
            except Exception as exc:  # noqa: BLE001 - a pickling error of the job, a failed start
                log.exception("tokenize_job_failed")
                self._fail(job, "internal", f"the router could not tokenise the prompt ({exc}); "
                           "the router's log has details")  # fmt: skip
                continue
            if status == "ok":
                if not job.future.done():
                    job.future.set_result(value)
            elif status == "error":
                if not job.future.done():
                    job.future.set_exception(value)
            elif status == "timeout":
                self._timed_out(job, waited=False)
            else:
                log.error("tokenize_worker_died", exit_code=value, pid=worker.process.pid)
                self._fail(job, "internal", f"the router's tokenizer process died (exit code "
                           f"{value}) on this prompt; it was restarted: retry the "
                           "request")  # fmt: skip
            if status in ("timeout", "died") or rss > RECYCLE_RSS_BYTES:
                self._workers[index] = None
                self.num_replaced += status in ("timeout", "died")
                await loop.run_in_executor(self._threads, worker.stop)

    def _timed_out(self, job: _Job, waited: bool) -> None:
        where = "waiting for the router's tokenizer" if waited else "tokenising"
        if (suppressed := self.throttle.allow("tokenize_timeout")) is not None:
            log.warning("tokenize_timeout", seconds=self.timeout, waited=waited,
                        suppressed=suppressed)  # fmt: skip
        self._fail(job, "timeout", f"the prompt was not tokenised within {self.timeout:g} s "
                   f"(tokenize_timeout_seconds; it timed out {where}): the router is "
                   "overloaded with long prompts; retry later or send a shorter one")  # fmt: skip

    @staticmethod
    def _fail(job: _Job, reason: str, message: str) -> None:
        if not job.future.done():
            job.future.set_exception(TokenizeFailed(reason, message))

    def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for job in self._jobs:
            self._fail(job, "draining", "the router is shutting down; retry the request")
        self._jobs.clear()
        for worker in self._workers:
            if worker is not None:
                worker.stop()
        self._threads.shutdown(wait=False, cancel_futures=True)
