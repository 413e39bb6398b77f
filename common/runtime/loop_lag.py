"""How late a periodic task of the loop woke up: the loop's own stall, not its peers'.

A peer's silence is judged by the loop that reads its answers. When that loop was
blocked (a long tokenisation, a swap storm, a SIGSTOP), every peer looks silent though
none is: the router declared a healthy decode down and failed 8 unrelated streams. A
periodic task measures how much later than asked it woke (:meth:`LoopLag.tick`); the
watcher moves every peer's last-heard time forward by that stall before judging it, and
the stall is logged and counted (``pdserve:loop_stalls``, ``pdserve:loop_lag_seconds``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import structlog

if TYPE_CHECKING:
    from pdserve.common.runtime.metrics import Metrics

log = structlog.get_logger("pdserve.loop")


class LoopLag:
    def __init__(
        self, interval: float, metrics: Metrics, clock: Callable[[], float] = time.monotonic
    ) -> None:
        """``interval``: how long the task sleeps between ticks."""
        self.interval = interval
        self.metrics = metrics
        self.clock = clock
        self._last: float | None = None
        metrics.declare("pdserve:loop_stalls")
        metrics.set("pdserve:loop_lag_seconds", 0.0)

    def tick(self) -> float:
        """Seconds the loop stalled since the last tick (beyond the interval slept); a
        stall longer than the interval is logged and counted."""
        now = self.clock()
        last, self._last = self._last, now
        if last is None:
            return 0.0
        lag = max(0.0, now - last - self.interval)
        self.metrics.set("pdserve:loop_lag_seconds", lag)
        if lag > self.interval:
            self.metrics.inc("pdserve:loop_stalls")
            log.warning("loop_stalled", seconds=round(lag, 3),
                        hint="peers' silence during it is not counted against them")  # fmt: skip
        return lag
