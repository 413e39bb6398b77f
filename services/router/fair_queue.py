"""The router's dispatch slots and the requests waiting for one, served fairly (pure).

The services queue what they are given: one client that kept 256 requests in flight put
every other client's request behind its backlog. So the router dispatches only ``slots``
requests at once (what the decode instances run, plus a small margin: their waiting
lines stay short) and the rest wait here, per client (its API key, SDK connection,
trusted ``user`` or peer address). One client holds at most ``share`` slots: the rest
stay free for another client's next request, dispatched at once.

A freed slot goes by the Virtual Token Counter ("Fairness in Serving Large Language
Models", OSDI 2024): each client has a counter of the tokens served to it (``serve``:
prompt tokens when dispatched, output tokens as they come); the slot goes to the waiting
request of the lowest ``priority`` (vLLM's: lower first), then of the client with the
lowest counter, then of the one holding fewest slots, then to the client whose turn came
least recently. A client that becomes
active (nothing running or waiting before) starts at the lowest counter among the active
ones: no credit saved up while idle, no debt from others' history. Work-conserving: a
slot is never left free while a request that may take it waits. Nothing waiting is
dropped; a waiter leaves only when it is given a slot or its request ends.
"""

from __future__ import annotations

import bisect
import itertools
from collections import OrderedDict

MAX_COUNTERS = 4096  # clients' counters kept; past it, those of idle clients are dropped


class FairQueue:
    def __init__(self, slots: int, share: int | None = None) -> None:
        """``share``: slots one client may hold (default: all)."""
        self.slots = slots
        self.share = slots if share is None else min(share, slots)
        self._running: dict[str, str] = {}  # request key -> owner, those holding a slot
        self._num_running: dict[str, int] = {}  # owner -> slots it holds
        # owner -> its waiting (priority, sequence, key), sorted; owners in turn order
        self._waiting: OrderedDict[str, list[tuple[int, int, str]]] = OrderedDict()
        self._seq = itertools.count()
        self.served: dict[str, float] = {}  # owner -> tokens served (its virtual counter)

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return sum(len(keys) for keys in self._waiting.values())

    def num_waiting_of(self, owner: str) -> int:
        return len(self._waiting.get(owner, ()))

    def join(self, owner: str, key: str, priority: int = 0) -> bool:
        """Whether ``key`` holds a slot now; else it waits for ``leave`` to hand it one."""
        if owner not in self._num_running and owner not in self._waiting:
            self._activate(owner)
        if len(self._running) < self.slots and self._num_running.get(owner, 0) < self.share:
            self._run(owner, key)
            return True
        bisect.insort(self._waiting.setdefault(owner, []), (priority, next(self._seq), key))
        return False

    def serve(self, owner: str, tokens: float) -> None:
        """Count ``tokens`` served to ``owner`` (prompt tokens dispatched, tokens generated)."""
        self.served[owner] = self.served.get(owner, 0.0) + tokens

    def leave(self, owner: str, key: str) -> list[str]:
        """``key`` is done (or gave up waiting); the keys this gives a slot to."""
        if self._running.pop(key, None) is None:
            waiting = self._waiting.get(owner)
            if waiting is not None:
                kept = [entry for entry in waiting if entry[2] != key]
                if not kept:
                    del self._waiting[owner]
                elif len(kept) < len(waiting):
                    self._waiting[owner] = kept
            return []
        left = self._num_running[owner] - 1
        if left:
            self._num_running[owner] = left
        else:
            del self._num_running[owner]
        granted = []
        while self._waiting and len(self._running) < self.slots:
            eligible = [o for o in self._waiting if self._num_running.get(o, 0) < self.share]
            if not eligible:  # every waiting client holds its share
                break
            # priority, counter, slots held; min keeps the first of equals: the owner whose
            # turn came least recently
            turn = min(eligible, key=self._rank)
            waiting = self._waiting[turn]
            granted.append(waiting.pop(0)[2])
            self._run(turn, granted[-1])
            if waiting:
                self._waiting.move_to_end(turn)
            else:
                del self._waiting[turn]
        return granted

    def _rank(self, owner: str) -> tuple[int, float, int]:
        return (self._waiting[owner][0][0], self.served.get(owner, 0.0),
                self._num_running.get(owner, 0))  # fmt: skip

    def _activate(self, owner: str) -> None:
        """An owner with nothing here starts at the lowest counter of the active ones."""
        active = self._num_running.keys() | self._waiting.keys()
        if len(self.served) > MAX_COUNTERS:
            self.served = {o: n for o, n in self.served.items() if o in active}
        floor = min((self.served.get(o, 0.0) for o in active), default=0.0)
        self.served[owner] = max(self.served.get(owner, 0.0), floor)

    def _run(self, owner: str, key: str) -> None:
        self._running[key] = owner
        self._num_running[owner] = self._num_running.get(owner, 0) + 1
