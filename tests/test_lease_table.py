"""LeaseTable: every rank tracked, blocks freed exactly once, expiry per rank."""

from pdserve.services.prefill.lease_table import LeaseTable


def test_blocks_free_only_when_every_rank_released() -> None:
    t = LeaseTable(num_ranks=3, lease_seconds=30)
    t.add("r", "t", [4, 5], now=0)
    assert t.release("r", 0) is None
    assert t.release("r", 0) is None  # a repeat changes nothing
    assert t.release("r", 2) is None
    freed = t.release("r", 1)
    assert freed is not None and freed.block_ids == [4, 5] and freed.expired_ranks == ()
    assert len(t) == 0
    assert t.release("r", 1) is None  # late: nothing held any more


def test_a_lost_release_on_one_rank_expires_that_rank_only() -> None:
    t = LeaseTable(num_ranks=2, lease_seconds=10)
    t.add("a", "t", [1], now=0)
    t.add("b", "t", [2], now=0)
    t.release("a", 0)
    assert t.release("b", 0) is None and t.release("b", 1) is not None
    assert t.expire(now=9.9) == []
    [freed] = t.expire(now=10)
    assert freed.request_id == "a" and freed.expired_ranks == (1,)


def test_heartbeats_extend_and_report_unknown_requests() -> None:
    t = LeaseTable(num_ranks=1, lease_seconds=10)
    t.add("a", "t", [1], now=0)
    assert t.extend(["a", "zz"], now=8) == ["zz"]
    assert t.expire(now=12) == []
    assert [f.request_id for f in t.expire(now=18)] == ["a"]
