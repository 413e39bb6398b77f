"""The router's dispatch slots and the requests waiting for one, served fairly (pure).

The services queue first come, first served: one client that kept 256 requests in
flight put every other client's request behind its backlog (a 4-token answer waited
10.9-13.7 s instead of 1.3 s). So the router dispatches only ``slots`` requests at once
(enough to keep the decode instances full) and the rest wait here, one FIFO per client
(its API key, SDK connection or peer address). One client holds at most ``share`` of
them: the rest stay free for the next request of another client, which is dispatched at
once instead of waiting for one of the busy client's requests to end. A freed slot goes
to the waiting client with the fewest requests dispatched, the one whose turn came least
recently on a tie: a client that arrives behind another's backlog runs next, and clients
with equal shares take turns. Nothing waiting is dropped; a waiter leaves only when it
is given a slot or its request ends (aborted, timed out).
"""

from __future__ import annotations

from collections import OrderedDict, deque


class FairQueue:
    def __init__(self, slots: int, share: int | None = None) -> None:
        """``share``: slots one client may hold (default: all)."""
        self.slots = slots
        self.share = slots if share is None else min(share, slots)
        self._running: dict[str, str] = {}  # request key -> owner, those holding a slot
        self._num_running: dict[str, int] = {}  # owner -> slots it holds
        self._waiting: OrderedDict[str, deque[str]] = OrderedDict()  # owner -> keys, in turn

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return sum(len(keys) for keys in self._waiting.values())

    def join(self, owner: str, key: str) -> bool:
        """Whether ``key`` holds a slot now; else it waits for ``leave`` to hand it one."""
        if len(self._running) < self.slots and self._num_running.get(owner, 0) < self.share:
            self._run(owner, key)
            return True
        self._waiting.setdefault(owner, deque()).append(key)
        return False

    def leave(self, owner: str, key: str) -> list[str]:
        """``key`` is done (or gave up waiting); the keys this gives a slot to."""
        if self._running.pop(key, None) is None:
            keys = self._waiting.get(owner)
            if keys is not None and key in keys:
                keys.remove(key)
                if not keys:
                    del self._waiting[owner]
            return []
        left = self._num_running[owner] - 1
        if left:
            self._num_running[owner] = left
        else:
            del self._num_running[owner]
        granted = []
        while self._waiting and len(self._running) < self.slots:
            # min keeps the first of equals: the owner whose turn came least recently
            turn = min(self._waiting, key=lambda o: self._num_running.get(o, 0))
            if self._num_running.get(turn, 0) >= self.share:  # and so is every other
                break
            keys = self._waiting[turn]
            granted.append(keys.popleft())
            self._run(turn, granted[-1])
            if keys:
                self._waiting.move_to_end(turn)
            else:
                del self._waiting[turn]
        return granted

    def _run(self, owner: str, key: str) -> None:
        self._running[key] = owner
        self._num_running[owner] = self._num_running.get(owner, 0) + 1
