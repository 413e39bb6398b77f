"""Repeated log lines at most once per interval per key, with how many were left out.

A lost SDK connection failed one send per token and logged one warning each; a peer or
an attacker sending bad frames can do the same at line rate. ``LogThrottle.allow(key)``
says whether a line for ``key`` (an event and what it is about: a peer, a client) may be
written now, and how many lines of that key were suppressed since the last one (to log
with it, so nothing is silently lost).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable

MAX_KEYS = 1024  # keys remembered at most; the oldest are forgotten first


class LogThrottle:
    def __init__(self, interval: float = 10.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.interval = interval
        self.clock = clock
        self._last: dict[Hashable, float] = {}  # key -> when its last line was written
        self._suppressed: dict[Hashable, int] = {}

    def allow(self, key: Hashable) -> int | None:
        """None: suppress this line (counted); else write it, noting the returned count
        of lines of ``key`` suppressed before it."""
        now = self.clock()
        last = self._last.get(key)
        if last is not None and now - last < self.interval:
            self._suppressed[key] = self._suppressed.get(key, 0) + 1
            return None
        self._last.pop(key, None)  # re-inserted last: dicts keep insertion order
        self._last[key] = now
        if len(self._last) > MAX_KEYS:
            oldest = next(iter(self._last))
            del self._last[oldest]
            self._suppressed.pop(oldest, None)
        return self._suppressed.pop(key, 0)
