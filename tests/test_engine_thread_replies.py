"""An engine thread's replies reach its service's loop once per turn, in order (#49): a
decode step of a batch of streams wakes the loop once for all of its tokens, not once per
token; anything else the thread posts still comes after the replies made before it."""

from __future__ import annotations

import asyncio
from typing import Any

from pdserve.common.runtime import protocol as p
from pdserve.common.runtime.engine_thread import EngineContext, EngineThread
from pdserve.common.runtime.metrics import Metrics
from pdserve.common.runtime.service_config import DeploymentConfig


def chunk(n: int) -> p.TokenChunk:
    return p.TokenChunk(request_id=f"r{n}", trace_id="", token_ids=[n], text=str(n))


class Batch(EngineThread):
    """Each turn of work: replies to three streams, a post, two more replies."""

    def __init__(self, ctx: EngineContext, loop: asyncio.AbstractEventLoop, turns: int) -> None:
        super().__init__(ctx, loop, name="replies")
        self.turns = turns
        self.done = asyncio.Event()

    def run_once(self) -> bool:
        if self.turns == 0:
            return False
        base = 10 * self.turns
        for n in range(3):
            self.reply(b"router", chunk(base + n))
        self.post(self.ctx.reply, b"router", chunk(base + 5))  # e.g. a side message
        for n in (6, 7):
            self.reply(b"router", chunk(base + n))
        self.turns -= 1
        if self.turns == 0:
            self.post(self.done.set)
        return True


def _context(reply: Any) -> EngineContext:
    return EngineContext(
        cfg=DeploymentConfig(), instance=0, torch_threads=1, metrics=Metrics("decode", 0),
        reply=reply,
    )  # fmt: skip


def test_a_turns_replies_reach_the_loop_together_and_in_order() -> None:
    got: list[tuple[bytes, int]] = []
    loop = asyncio.new_event_loop()
    ctx = _context(lambda identity, msg: got.append((identity, msg.token_ids[0])))
    thread = Batch(ctx, loop, turns=2)
    wakeups: list[Any] = []
    threadsafe = loop.call_soon_threadsafe

    def counted(callback: Any, *args: Any) -> Any:
        wakeups.append(callback)
        return threadsafe(callback, *args)

    loop.call_soon_threadsafe = counted  # type: ignore[method-assign]
    thread.start()
    try:
        loop.run_until_complete(asyncio.wait_for(thread.done.wait(), 30))
    finally:
        thread.stop()
        thread.join(10)
        loop.close()
    assert thread.failed is None
    expected = [20, 21, 22, 25, 26, 27, 10, 11, 12, 15, 16, 17]
    assert got == [(b"router", n) for n in expected]
    # per turn: the three replies at once, the post, the two replies at once; the end
    assert len(wakeups) == 2 * 3 + 1


def test_replies_outside_a_turn_are_posted_at_once() -> None:
    """A thread turned by hand (the tests of the services' threads) posts each reply."""
    got: list[int] = []
    loop = asyncio.new_event_loop()
    ctx = _context(lambda identity, msg: got.append(msg.token_ids[0]))
    thread = Batch(ctx, loop, turns=1)
    thread.post = lambda callback, *args: callback(*args)  # type: ignore[method-assign]
    thread.run_once()
    loop.close()
    assert got == [10, 11, 12, 15, 16, 17]


def test_model_steps_are_reported_by_kind() -> None:
    """pdserve:model_steps_total{kind}: the runner's totals, as increments each report."""
    from types import SimpleNamespace

    from pdserve.common.runtime.engine_thread import report_engine

    sched = SimpleNamespace(running=[], waiting=[], num_preemptions=0, num_abandoned_tokens=0,
                            num_replayed_tokens=0)  # fmt: skip
    runner = SimpleNamespace(num_graph_steps=3, num_eager_steps=5)
    engine = SimpleNamespace(scheduler=sched, pool=SimpleNamespace(num_free_blocks=1, tier=None),
                             runner=runner)  # fmt: skip
    metrics = Metrics("decode", 0)
    report_engine(metrics, engine, 0, 0)
    runner.num_graph_steps, runner.num_eager_steps = 10, 6
    report_engine(metrics, engine, 0, 0)
    assert metrics.value("pdserve:model_steps", kind="graph") == 10
    assert metrics.value("pdserve:model_steps", kind="eager") == 6
    report_engine(metrics, SimpleNamespace(scheduler=sched, pool=engine.pool), 0, 0)  # no runner
    assert metrics.value("pdserve:model_steps", kind="graph") == 10


def test_metric_keys_are_the_same_cached_or_not() -> None:
    """Metrics._key answers from a cache (the router's per-token observations): the same
    series whatever the labels' order or type, an unknown name refused every time."""
    import pytest

    metrics = Metrics("router", 0)
    for _ in range(3):
        metrics.inc("pdserve:requests", finish_reason="stop")
        metrics.inc("pdserve:model_steps", 2, kind="graph", rank=0)
        metrics.inc("pdserve:model_steps", 1, rank="0", kind="graph")
    assert metrics.value("pdserve:requests", finish_reason="stop") == 3
    assert metrics.value("pdserve:model_steps", kind="graph") == 9
    for _ in range(2):
        with pytest.raises(KeyError):
            metrics.inc("pdserve:no_such_metric")
