"""The router's tokenize pool (issue 40, item 2): a stuck or dying worker fails only its
own job, with a reason, within the deadline; it is replaced and the jobs behind it run."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path
from typing import Any

import pytest

from pdserve.common.errors import RequestError
from pdserve.services.router.tokenize_pool import TokenizeFailed, TokenizePool

pytestmark = pytest.mark.slow

DEADLINE = 4.0  # a replacement worker starts in ~1.6 s here, more when the machine is busy


def encode(core: Any, text: str) -> list[int]:
    return list(core.tokenizer.encode(text))


def hang(core: Any, _: object) -> None:
    time.sleep(600)


def die(core: Any, _: object) -> None:
    os._exit(3)


def refuse(core: Any, _: object) -> None:
    raise RequestError("refused in the worker")


def test_a_stuck_or_dead_worker_fails_its_job_alone_and_is_replaced(model_dir: Path) -> None:
    async def main() -> None:
        pool = TokenizePool(model_dir, timeout=DEADLINE, max_waiting=64)
        await pool.start()
        try:
            first = pool.worker_pids()
            assert await pool.run(encode, "hello world") == await pool.run(encode, "hello world")
            with pytest.raises(RequestError, match="refused in the worker"):
                await pool.run(refuse, None)  # the caller's error, as it was raised

            started = time.monotonic()
            stuck = asyncio.create_task(pool.run(hang, None))
            behind = [asyncio.create_task(pool.run(encode, f"prompt {k}")) for k in range(20)]
            with pytest.raises(TokenizeFailed) as info:
                await stuck
            took = time.monotonic() - started
            assert info.value.reason == "timeout" and "tokenize_timeout_seconds" in str(info.value)
            assert took < DEADLINE + 1.0, took
            # behind the stuck job: answered by the replacement, or refused by their own
            # deadline (they waited too), never left hanging
            for outcome in await asyncio.gather(*behind, return_exceptions=True):
                assert isinstance(outcome, list) or (
                    isinstance(outcome, TokenizeFailed) and outcome.reason == "timeout"
                ), outcome
            assert await pool.run(encode, "after") and pool.worker_pids() != first

            with pytest.raises(TokenizeFailed) as died:
                await pool.run(die, None)
            assert died.value.reason == "internal" and "exit code 3" in str(died.value)
            assert await pool.run(encode, "after a death")
            assert pool.num_replaced == 2
        finally:
            pool.close()

    asyncio.run(main())


def test_the_queue_is_bounded(model_dir: Path) -> None:
    async def main() -> None:
        pool = TokenizePool(model_dir, timeout=5.0, max_waiting=2)
        await pool.start()
        try:
            jobs = [asyncio.create_task(pool.run(encode, "x " * 50_000)) for _ in range(6)]
            outcomes = await asyncio.gather(*jobs, return_exceptions=True)
            refused = [o for o in outcomes if isinstance(o, TokenizeFailed)]
            assert refused and all(o.reason == "overloaded" for o in refused), outcomes
            assert sum(isinstance(o, list) for o in outcomes) >= 2
        finally:
            pool.close()

    asyncio.run(main())
