"""KV transfer by NIXL READ between real processes (UCX over DRAM on CPU).

Two producer processes (spawn) are two replicas of one prefill engine holding identical
caches filled from one seed; the consumer runs in the test process and checks the bytes
it pulled against the same seeded fill. Every wait is bounded; children are stopped by
the fixture's finalizer and are daemons, so they never outlive the test run.
"""

from __future__ import annotations

import multiprocessing as mp
import time
import uuid
from collections.abc import Iterator
from multiprocessing.connection import Connection
from typing import Any

import msgspec
import pytest
import torch
from pdserve.common.kv_layout import KVLayout
from pdserve.common.protocol import (
    Decoder,
    HandshakeReply,
    Heartbeat,
    KVHandle,
    Release,
    Replica,
    encode,
)

pytest.importorskip("nixl")

from pdserve.common.kv_transfer import KVConsumer, KVTransferError, coalesce

LAYOUT = KVLayout(num_blocks=32, num_layers=2, num_kv_heads=2, block_size=4, head_dim=8, dtype="float32")
COMPAT = {"model": "tiny-random", "kv_cache_dtype": "float32"}
ENGINE, EPOCH, SEED = "prefill-0", 7, 1234
AGENTS = ("prefill-0-rank0", "prefill-0-rank1")
WAIT_S = 20.0


def seeded_cache(layout: KVLayout, seed: int) -> torch.Tensor:
    # [num_blocks, num_layers, 2, H_kv, block_size, head_dim]; same bytes in every process
    return torch.randn(layout.shape, generator=torch.Generator().manual_seed(seed))


def _producer_main(conn: Connection, agent_name: str) -> None:
    """Child: serve the seeded cache; answer 'state' with (releases, bad count)."""
    torch.set_num_threads(1)
    from pdserve.common.kv_transfer import KVProducer

    producer = KVProducer(engine_id=ENGINE, epoch=EPOCH, agent_name=agent_name,
                          kv_cache=seeded_cache(LAYOUT, SEED), layout=LAYOUT, compat=COMPAT)
    releases: list[bytes] = []
    try:
        conn.send_bytes(encode(producer.handshake_reply))
        while True:
            releases += [encode(r) for r in producer.poll_releases()]
            if conn.poll(0.005):
                if conn.recv() == "stop":
                    return
                conn.send((releases, producer.num_bad_notifications))
    except (EOFError, BrokenPipeError):  # the test process is gone: exit too
        pass
    finally:
        producer.close()


class ProducerProc:
    def __init__(self, ctx: Any, agent_name: str) -> None:
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_producer_main, args=(child, agent_name), daemon=True)
        self.proc.start()
        child.close()
        self.reply: HandshakeReply | None = None

    def read_reply(self) -> HandshakeReply:
        if self.reply is None:
            assert self.conn.poll(WAIT_S), "producer gave no handshake reply in time"
            self.reply = Decoder(HandshakeReply).decode(self.conn.recv_bytes())
        return self.reply

    def state(self) -> tuple[list[Release], int]:
        self.conn.send("state")
        assert self.conn.poll(WAIT_S), "producer did not answer"
        raw, bad = self.conn.recv()
        return [Decoder(Release).decode(r) for r in raw], bad

    def stop(self) -> None:
        try:
            self.conn.send("stop")
        except (OSError, ValueError):
            pass
        self.proc.join(5)
        if self.proc.is_alive():
            self.proc.terminate()
            self.proc.join(5)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)


@pytest.fixture(scope="module")
def producers(request: pytest.FixtureRequest) -> list[ProducerProc]:
    ctx = mp.get_context("spawn")
    procs: list[ProducerProc] = []
    request.addfinalizer(lambda: [p.stop() for p in procs])
    procs += [ProducerProc(ctx, name) for name in AGENTS]
    for p in procs:
        p.read_reply()
    return procs


@pytest.fixture
def consumer() -> Iterator[KVConsumer]:
    c = KVConsumer(agent_name=f"decode-{uuid.uuid4().hex[:8]}", kv_cache=torch.zeros(LAYOUT.shape),
                   layout=LAYOUT, compat=COMPAT, capture_telemetry=True)
    try:
        yield c
    finally:
        c.close()


def make_handle(block_ids: list[int], agents: tuple[str, ...] = AGENTS, epoch: int = EPOCH) -> KVHandle:
    return KVHandle(engine_id=ENGINE, epoch=epoch, layout=LAYOUT, block_ids=block_ids,
                    num_tokens=len(block_ids) * LAYOUT.block_size,
                    replicas=[Replica(agent_name=a, side_channel="") for a in agents],
                    lease_deadline=time.time() + 30)


def wait_pull(consumer: KVConsumer, pull: Any) -> None:
    deadline = time.monotonic() + WAIT_S
    while not consumer.poll(pull):
        assert time.monotonic() < deadline, f"pull {pull} did not finish in time"
        time.sleep(0.001)


def wait_producer(proc: ProducerProc, ok: Any) -> tuple[list[Release], int]:
    deadline = time.monotonic() + WAIT_S
    while True:
        releases, bad = proc.state()
        if ok(releases, bad):
            return releases, bad
        assert time.monotonic() < deadline, f"producer state not reached: {releases}, bad={bad}"
        time.sleep(0.02)


def connect_all(consumer: KVConsumer, producers: list[ProducerProc]) -> None:
    for p in producers:
        consumer.connect(p.read_reply())


def test_pull_non_contiguous_blocks_coalesced(producers: list[ProducerProc], consumer: KVConsumer) -> None:
    connect_all(consumer, producers)
    # runs: 3-5->0-2, 9->7, 12-13->10-11, 20->15, 30-31->16-17, then remote-adjacent but
    # local-apart 21->25, 22->27 (two descriptors): 7 descriptors for 11 blocks.
    remote = [3, 4, 5, 9, 12, 13, 20, 30, 31, 21, 22]
    local = [0, 1, 2, 7, 10, 11, 15, 16, 17, 25, 27]
    pull = consumer.start_pull("req-pull", make_handle(remote), local, replica=1)
    wait_pull(consumer, pull)

    assert pull.num_descriptors == len(coalesce(remote, local)) == 7
    assert pull.nixl_descriptors == 7  # NIXL really merged the runs
    assert pull.num_bytes == len(remote) * LAYOUT.block_bytes
    expected = seeded_cache(LAYOUT, SEED)
    assert torch.equal(consumer.kv_cache[local], expected[remote])
    untouched = [b for b in range(LAYOUT.num_blocks) if b not in local]
    assert not consumer.kv_cache[untouched].any()


def test_release_reaches_every_replica(producers: list[ProducerProc], consumer: KVConsumer) -> None:
    connect_all(consumer, producers)
    handle = make_handle([1, 2, 3])
    pull = consumer.start_pull("req-rel", handle, [4, 5, 6], replica=0)
    wait_pull(consumer, pull)
    assert consumer.release(handle, "req-rel", trace_id="t-1") == []

    want = Release(request_id="req-rel", trace_id="t-1", engine_id=ENGINE, epoch=EPOCH)
    for p in producers:  # replica 1 was not read from and is released too
        releases, _ = wait_producer(p, lambda rs, _: any(r.request_id == "req-rel" for r in rs))
        time.sleep(0.05)
        releases, _ = p.state()
        assert [r for r in releases if r.request_id == "req-rel"] == [want]

    # A replica never handshaken cannot be notified: its index comes back for the fallback.
    assert consumer.release(make_handle([1], (*AGENTS, "ghost")), "req-ghost") == [2]


def test_incompatible_handshake_refused(producers: list[ProducerProc], consumer: KVConsumer) -> None:
    reply = producers[0].read_reply()
    bad = msgspec.structs.replace(
        reply, compat={**COMPAT, "model": "other-model"},
        layout=msgspec.structs.replace(LAYOUT, block_size=16),
    )
    with pytest.raises(KVTransferError) as err:
        consumer.connect(bad)
    msg = str(err.value)
    assert "compat['model']: local='tiny-random' remote='other-model'" in msg
    assert "layout.block_size: local=4 remote=16" in msg
    assert AGENTS[0] in msg and "epoch 7" in msg
    assert not consumer.is_connected(ENGINE, EPOCH)


def test_stale_or_unknown_handle_refused(producers: list[ProducerProc], consumer: KVConsumer) -> None:
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
    with pytest.raises(KVTransferError, match=r"req-oob.*remote block ids \[32\] outside \[0, 32\)"):
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
        target, lambda rs, b: b >= bad_before + 3 and any(r.request_id == "req-after-bad" for r in rs)
    )
    assert bad == bad_before + 3
    assert target.proc.is_alive()
    assert not any(r.request_id == "req-stale" for r in releases)


def test_coalesce_runs() -> None:
    assert coalesce([], []) == []
    assert coalesce([5, 6, 7], [0, 1, 2]) == [(5, 0, 3)]
    assert coalesce([5, 6, 8], [0, 1, 2]) == [(5, 0, 2), (8, 2, 1)]
    assert coalesce([1, 2], [4, 3]) == [(1, 4, 1), (2, 3, 1)]
