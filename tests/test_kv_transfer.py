"""KV transfer by NIXL READ between real processes (UCX over DRAM on CPU).

Two producer processes (spawn) are two replicas of one prefill engine holding identical
caches filled from one seed; a third, of another engine, is killed by the crash test.
The consumer runs in the test process and checks the bytes it pulled against the same
seeded fill. Every wait is bounded; children are stopped by the fixture's finalizer and
are daemons, so they never outlive the test run.
"""

from __future__ import annotations

import multiprocessing as mp
import socket
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
import torch

from pdserve.common.engine.kv_cache import new_cache
from pdserve.common.runtime import sd_notify
from pdserve.common.runtime.protocol import (
    Heartbeat,
    Release,
    encode,
)
from pdserve.common.runtime.sd_notify import Watchdog
from pdserve.common.transfer.kv_consumer import KVConsumer
from pdserve.common.transfer.kv_descs import coalesce
from pdserve.common.transfer.kv_transfer import KVTransferError
from tests.kv_transfer_harness import (
    AGENTS,
    COMPAT,
    ENGINE,
    EPOCH,
    LAYOUT,
    SEED,
    START_WAIT_S,
    VICTIM,
    VICTIM_ENGINE,
    WAIT_S,
    ProducerProc,
    connect_all,
    make_handle,
    seeded_cache,
    wait_producer,
    wait_pull,
)

pytest.importorskip("nixl")


@pytest.fixture(scope="module")
def all_producers(request: pytest.FixtureRequest) -> list[ProducerProc]:
    """Two replicas of ENGINE, and a victim of another engine for the crash test: started
    together, because a child's start (torch + UCX) is most of this module's time."""
    ctx = mp.get_context("spawn")
    procs: list[ProducerProc] = []

    def stop_all() -> None:
        for p in procs:  # all shut down at once, then are joined (and killed if stuck)
            p.ask_stop()
        for p in procs:
            p.stop()

    request.addfinalizer(stop_all)
    procs += [ProducerProc(ctx, name) for name in AGENTS]
    procs.append(ProducerProc(ctx, VICTIM, engine_id=VICTIM_ENGINE))
    for p in procs:
        p.read_reply(START_WAIT_S)
    return procs


@pytest.fixture
def producers(all_producers: list[ProducerProc]) -> list[ProducerProc]:
    return all_producers[:2]


@pytest.fixture
def consumer() -> Iterator[KVConsumer]:
    c = KVConsumer(
        agent_name=f"decode-{uuid.uuid4().hex[:8]}",
        kv_cache=new_cache(LAYOUT),
        layout=LAYOUT,
        compat=COMPAT,
        capture_telemetry=True,
    )
    try:
        yield c
    finally:
        c.close()


def test_pull_non_contiguous_blocks_coalesced(
    producers: list[ProducerProc], consumer: KVConsumer
) -> None:
    connect_all(consumer, producers)
    # runs: 3-5->0-2, 9->7, 12-13->10-11, 20->15, 30-31->16-17, then remote-adjacent but
    # local-apart 21->25, 22->27 (two descriptors): 7 descriptors for 11 blocks.
    remote = [3, 4, 5, 9, 12, 13, 20, 30, 31, 21, 22]
    local = [0, 1, 2, 7, 10, 11, 15, 16, 17, 25, 27]
    pull = consumer.start_pull("req-pull", make_handle(remote), local, replica=1)
    wait_pull(consumer, pull)

    # one descriptor per (head, run): the layout is head-major
    assert pull.num_descriptors == len(coalesce(remote, local)) * LAYOUT.num_kv_heads == 14
    assert pull.nixl_descriptors == 14  # NIXL really merged the runs
    assert pull.num_bytes == len(remote) * LAYOUT.block_bytes
    expected = seeded_cache(LAYOUT, SEED)
    assert torch.equal(consumer.kv_cache[local], expected[remote])
    untouched = [b for b in range(LAYOUT.num_blocks) if b not in local]
    assert not consumer.kv_cache[untouched].any()


def test_pull_head_slice_into_a_smaller_tp_layout(producers: list[ProducerProc]) -> None:
    """A consumer holding one KV head (TP 2 over 2 heads) reads head 1 of a TP-1 producer:
    one descriptor per run of blocks, and exactly that head's bytes."""
    half = msgspec.structs.replace(LAYOUT, num_kv_heads=1)
    consumer = KVConsumer(
        agent_name=f"decode-{uuid.uuid4().hex[:8]}",
        kv_cache=new_cache(half),
        layout=half,
        compat=COMPAT,
        capture_telemetry=True,
    )
    try:
        connect_all(consumer, producers)
        remote, local = [8, 9, 10, 11, 20], [0, 1, 2, 3, 9]
        pull = consumer.start_pull(
            "req-slice", make_handle(remote), local, replica=0, heads=[(1, 0, 1)]
        )
        wait_pull(consumer, pull)
        assert pull.num_descriptors == pull.nixl_descriptors == 2
        assert pull.num_bytes == len(remote) * half.block_bytes
        expected = seeded_cache(LAYOUT, SEED)[remote][:, :, :, 1:2]
        assert torch.equal(consumer.kv_cache[local], expected)
        with pytest.raises(KVTransferError, match="head slice"):
            consumer.start_pull("req-bad", make_handle(remote), local, heads=[(1, 0, 2)])
    finally:
        consumer.close()


def test_block_order_consumer_reads_head_order_producer(producers: list[ProducerProc]) -> None:
    """The two sides' storage orders may differ: the bytes land right, and only units
    contiguous on both sides merge (here one per (head, block) where heads meet)."""
    blocky = msgspec.structs.replace(LAYOUT, order="block")
    consumer = KVConsumer(
        agent_name=f"decode-{uuid.uuid4().hex[:8]}",
        kv_cache=new_cache(blocky),
        layout=blocky,
        compat=COMPAT,
        capture_telemetry=True,
    )
    try:
        connect_all(consumer, producers)
        remote, local = [4, 5, 6, 17], [0, 1, 2, 9]
        pull = consumer.start_pull("req-mixed", make_handle(remote), local, replica=1)
        wait_pull(consumer, pull)
        # locally the heads of a block are adjacent, remotely the blocks of a head: no
        # pair is adjacent on both sides, so every (head, block) unit is a descriptor
        assert pull.num_descriptors == pull.nixl_descriptors == len(remote) * LAYOUT.num_kv_heads
        assert torch.equal(consumer.kv_cache[local], seeded_cache(LAYOUT, SEED)[remote])
    finally:
        consumer.close()


def test_release_reaches_every_replica(producers: list[ProducerProc], consumer: KVConsumer) -> None:
    connect_all(consumer, producers)
    handle = make_handle([1, 2, 3])
    pull = consumer.start_pull("req-rel", handle, [4, 5, 6], replica=0)
    wait_pull(consumer, pull)
    assert consumer.release(handle, "req-rel", trace_id="t-1") == []

    for index, p in enumerate(producers):  # replica 1 was not read from and is released too
        want = Release(
            request_id="req-rel", trace_id="t-1", engine_id=ENGINE, epoch=EPOCH, rank=index
        )
        releases, _ = wait_producer(
            p, lambda rs, _: any(r.request_id == "req-rel" for r in rs), consumer
        )
        time.sleep(0.05)
        releases, _ = p.state()
        assert [r for r in releases if r.request_id == "req-rel"] == [want]

    # A replica never handshaken cannot be notified: its index comes back for the fallback.
    assert consumer.release(make_handle([1], (*AGENTS, "ghost")), "req-ghost") == [2]


def test_incompatible_handshake_refused(
    producers: list[ProducerProc], consumer: KVConsumer
) -> None:
    reply = producers[0].read_reply()
    bad = msgspec.structs.replace(
        reply,
        compat={**COMPAT, "model": "other-model"},
        layout=msgspec.structs.replace(LAYOUT, block_size=16),
    )
    with pytest.raises(KVTransferError) as err:
        consumer.connect(bad)
    msg = str(err.value)
    assert "compat['model']: local='tiny-random' remote='other-model'" in msg
    assert "layout.block_size: local=4 remote=16" in msg
    assert AGENTS[0] in msg and "epoch 7" in msg
    assert not consumer.is_connected(ENGINE, EPOCH)


def test_stale_or_unknown_handle_refused(
    producers: list[ProducerProc], consumer: KVConsumer
) -> None:
    with pytest.raises(KVTransferError, match="not connected"):
        consumer.start_pull("req-nc", make_handle([0]), [0])
    connect_all(consumer, producers)
    assert consumer.is_connected(ENGINE, EPOCH, AGENTS[1])
    with pytest.raises(KVTransferError, match=r"req-old.*epoch 6.*stale epoch"):
        consumer.start_pull("req-old", make_handle([0], epoch=EPOCH - 1), [0])


def test_out_of_range_blocks_refused_then_pull_still_works(
    producers: list[ProducerProc], consumer: KVConsumer
) -> None:
    connect_all(consumer, producers)
    oob = r"req-oob.*remote block ids \[32\] outside \[0, 32\)"
    with pytest.raises(KVTransferError, match=oob):
        consumer.start_pull("req-oob", make_handle([30, 31, 32]), [0, 1, 2])
    with pytest.raises(KVTransferError, match="local block ids"):
        consumer.start_pull("req-oob", make_handle([0]), [-1])
    with pytest.raises(KVTransferError, match="2 remote blocks but 1 local"):
        consumer.start_pull("req-oob", make_handle([0, 1]), [0])
    pull = consumer.start_pull("req-ok", make_handle(list(range(32))), list(range(32)))
    wait_pull(consumer, pull)
    assert pull.num_descriptors == 1 and pull.nixl_descriptors == 1
    assert torch.equal(consumer.kv_cache, seeded_cache(LAYOUT, SEED))


def test_malformed_notification_counted_not_raised(
    producers: list[ProducerProc], consumer: KVConsumer
) -> None:
    connect_all(consumer, producers)
    target = producers[0]
    _, bad_before = target.state()
    garbage = [
        b"\x00 not msgpack",
        encode(Heartbeat(engine_id=ENGINE, epoch=EPOCH, request_ids=["x"])),  # wrong type
        encode(Release(request_id="req-stale", engine_id=ENGINE, epoch=EPOCH - 1)),  # old life
    ]
    for raw in garbage:
        consumer._agent.send_notif(AGENTS[0], raw)
    assert consumer.release(make_handle([0]), "req-after-bad") == []

    releases, bad = wait_producer(
        target,
        lambda rs, b: b >= bad_before + 3 and any(r.request_id == "req-after-bad" for r in rs),
        consumer,
    )
    assert bad == bad_before + 3
    assert target.proc.is_alive()
    assert not any(r.request_id == "req-stale" for r in releases)


def test_coalesce_runs() -> None:
    assert coalesce([], []) == []
    assert coalesce([5, 6, 7], [0, 1, 2]) == [(5, 0, 3)]
    assert coalesce([5, 6, 8], [0, 1, 2]) == [(5, 0, 2), (8, 2, 1)]
    assert coalesce([1, 2], [4, 3]) == [(1, 4, 1), (2, 3, 1)]


def test_restarted_producer_epoch_replaces_old(
    producers: list[ProducerProc], consumer: KVConsumer
) -> None:
    # Same agents seen under a newer epoch (a restart keeping agent names): the old epoch
    # is forgotten and its handles refused; an older handshake is refused too.
    connect_all(consumer, producers)
    for p in producers:
        consumer.connect(msgspec.structs.replace(p.read_reply(), epoch=EPOCH + 1))
    assert not consumer.is_connected(ENGINE, EPOCH)
    assert consumer.is_connected(ENGINE, EPOCH + 1, AGENTS[0])
    with pytest.raises(KVTransferError, match=r"stale epoch \(connected: \[8\]\)"):
        consumer.start_pull("req-e7", make_handle([0]), [0])
    with pytest.raises(KVTransferError, match="stale epoch, epoch 8 is connected"):
        consumer.connect(producers[0].read_reply())
    pull = consumer.start_pull("req-e8", make_handle([5, 6], epoch=EPOCH + 1), [0, 1])
    wait_pull(consumer, pull)
    assert torch.equal(consumer.kv_cache[[0, 1]], seeded_cache(LAYOUT, SEED)[[5, 6]])
    consumer.disconnect(ENGINE, EPOCH + 1)
    assert not consumer.is_connected(ENGINE, EPOCH + 1)


def test_connect_reloads_a_remote_a_read_failed_from(
    producers: list[ProducerProc], consumer: KVConsumer
) -> None:
    """Issue 41: after a READ from a replica failed (a partition), the decode's connect
    ahead reaching the producer again calls connect with the same reply: the remote is
    loaded again at once (no backoff), and a pull from it works; a connected, healthy
    remote is left as it is. The failure is marked as ``KVConsumer._finish`` marks it (a
    real cut: tests/test_multihost.py)."""
    connect_all(consumer, producers)
    reply = producers[0].read_reply()
    key = (reply.engine_id, reply.epoch, reply.agent_name)
    healthy = consumer._remotes[key]
    consumer.connect(reply)
    assert consumer._remotes[key] is healthy
    healthy.failed = True  # as a READ that ended in error leaves it
    consumer.connect(reply)
    again = consumer._remotes[key]
    assert again is not healthy and not again.failed
    pull = consumer.start_pull("req-again", make_handle([4, 5]), [0, 1])
    wait_pull(consumer, pull)
    assert torch.equal(consumer.kv_cache[[0, 1]], seeded_cache(LAYOUT, SEED)[[4, 5]])
    assert consumer.release(make_handle([4, 5]), "req-again") == []


def test_loading_a_producer_pings_the_watchdog_first(
    producers: list[ProducerProc],
    consumer: KVConsumer,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Issue 41: loading a producer's NIXL metadata connects to it, and an unreachable one
    (a reconnect during a partition) holds the pulling thread, which kicks the watchdog,
    for UCX's connect timeout: the load pings first (sd_notify.before_wait), within the
    watchdog's interval, so the wait counts from a fresh ping (the wait itself across
    hosts: tests/test_multihost.py)."""
    path = str(tmp_path / "notify.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as systemd:
        systemd.bind(path)
        systemd.settimeout(5)
        monkeypatch.setenv("NOTIFY_SOCKET", path)
        monkeypatch.setenv("WATCHDOG_USEC", str(3600 * 10**6))  # an interval of 30 minutes
        monkeypatch.delenv("WATCHDOG_PID", raising=False)
        monkeypatch.setattr(sd_notify, "_current", None)
        dog = Watchdog.from_env()
        assert dog is not None
        dog.kick()
        assert systemd.recv(64) == b"WATCHDOG=1"
        consumer.connect(producers[0].read_reply())
        assert systemd.recv(64) == b"WATCHDOG=1"


def test_dead_producer_fails_pull_and_release(
    all_producers: list[ProducerProc], consumer: KVConsumer
) -> None:
    victim = all_producers[2]
    consumer.connect(victim.read_reply())
    handle = make_handle([0, 1], (VICTIM,), engine=VICTIM_ENGINE)
    wait_pull(consumer, consumer.start_pull("req-alive", handle, [0, 1]))
    victim.proc.kill()
    victim.proc.join(5)
    # The READ fails at post or at poll (UCX notices the peer at its own pace): either
    # way a KVTransferError naming request and peer, within the bound, never a hang.
    with pytest.raises(KVTransferError, match=rf"req-dead.*{VICTIM}.*epoch 7"):
        wait_pull(consumer, consumer.start_pull("req-dead", handle, [2, 3]))
    deadline = time.monotonic() + WAIT_S
    while consumer.release(handle, "req-dead") != [0]:  # the caller's ZMQ fallback
        assert time.monotonic() < deadline, "release to a dead replica never reported failed"
        time.sleep(0.05)


def test_nixl_imported_lazily() -> None:
    # Importing the module must not need nixl: no module-level nixl import.
    import ast
    import inspect

    from pdserve.common.transfer import kv_consumer, kv_descs, kv_transfer

    for module in (kv_transfer, kv_consumer, kv_descs):
        tree = ast.parse(inspect.getsource(module))
        top = [n for n in tree.body if isinstance(n, ast.Import | ast.ImportFrom)]
        names = [a.name for n in top if isinstance(n, ast.Import) for a in n.names]
        names += [n.module or "" for n in top if isinstance(n, ast.ImportFrom)]
        assert not [n for n in names if n.split(".")[0] == "nixl"], module.__name__


def test_handshake_refuses_another_kv_cache_dtype_naming_both(
    producers: list[ProducerProc], consumer: KVConsumer
) -> None:
    """A producer whose cache is fp8 (or fp8 with other scales) is refused by a float32
    decode before any read: a pull moves bytes and never converts them."""
    reply = producers[0].read_reply()
    fp8 = msgspec.structs.replace(LAYOUT, dtype="float8_e4m3fn")
    bad = msgspec.structs.replace(reply, compat={**COMPAT, "dtype": "float8_e4m3fn"}, layout=fp8)
    with pytest.raises(KVTransferError) as err:
        consumer.connect(bad)
    msg = str(err.value)
    assert (
        "KV cache dtype: this decode stores float32 (--kv-cache-dtype auto), the producer "
        "float8_e4m3fn (--kv-cache-dtype fp8, k_scale 1, v_scale 1)"
    ) in msg
    assert "compat['dtype']" not in msg  # said once
    assert not consumer.is_connected(ENGINE, EPOCH)
    from pdserve.common.transfer.kv_transfer import kv_dtype_mismatch

    rescaled = msgspec.structs.replace(fp8, k_scale=0.5)
    assert "k_scale 0.5" in (kv_dtype_mismatch(fp8, rescaled) or "")
    assert kv_dtype_mismatch(fp8, fp8) is None
