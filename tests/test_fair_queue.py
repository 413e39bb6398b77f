"""The router's fair admission (services/router/fair_queue.py) and the log throttle
(common/runtime/log_throttle.py): pure cores, no sockets."""

from __future__ import annotations

from pdserve.common.runtime.log_throttle import LogThrottle
from pdserve.services.router.fair_queue import FairQueue


def test_a_newcomer_runs_next_behind_another_clients_backlog() -> None:
    q = FairQueue(slots=4)
    assert all(q.join("greedy", f"g{k}") for k in range(4))
    assert not any(q.join("greedy", f"g{k}") for k in range(4, 256))
    assert not q.join("other", "o0")
    assert (q.num_running, q.num_waiting) == (4, 253)
    assert q.leave("greedy", "g0") == ["o0"]  # fewest slots held: before the backlog
    assert q.leave("greedy", "g1") == ["g4"]  # then the backlog, in its own order
    assert q.leave("other", "o0") == ["g5"]


def test_one_client_leaves_room_for_the_next_clients_request() -> None:
    q = FairQueue(slots=5, share=4)
    assert [q.join("greedy", f"g{k}") for k in range(6)] == [True] * 4 + [False] * 2
    assert q.join("other", "o0")  # the slot kept free: at once
    assert not q.join("other", "o1")
    assert q.leave("other", "o0") == ["o1"]  # not greedy's: it holds its share
    assert q.leave("greedy", "g0") == ["g4"]  # back to its share
    assert q.leave("other", "o1") == []  # the kept slot stays free
    assert q.leave("greedy", "g1") == ["g5"]


def test_clients_with_equal_shares_take_turns() -> None:
    q = FairQueue(slots=2)
    q.join("a", "a0")
    q.join("b", "b0")
    for k in range(1, 4):
        q.join("a", f"a{k}")
        q.join("b", f"b{k}")
    order = []
    running = ["a0", "b0"]
    while running:
        done = running.pop(0)
        granted = q.leave(done[0], done)
        order += granted
        running += granted
    assert order == ["a1", "b1", "a2", "b2", "a3", "b3"]
    assert (q.num_running, q.num_waiting) == (0, 0)


def test_a_waiter_that_leaves_frees_nothing_and_is_never_granted() -> None:
    q = FairQueue(slots=1)
    q.join("a", "a0")
    q.join("b", "b0")
    q.join("b", "b1")
    assert q.leave("b", "b0") == []  # aborted while waiting
    assert q.leave("a", "a0") == ["b1"]
    assert q.leave("b", "b1") == [] and q.num_running == 0


def test_a_repeated_line_is_written_once_per_interval_with_the_count_left_out() -> None:
    now = [0.0]
    throttle = LogThrottle(interval=10.0, clock=lambda: now[0])
    assert throttle.allow(("send_failed", "client-1")) == 0
    assert all(throttle.allow(("send_failed", "client-1")) is None for _ in range(99))
    assert throttle.allow(("send_failed", "client-2")) == 0  # another key: its own line
    now[0] = 10.0
    assert throttle.allow(("send_failed", "client-1")) == 99
