"""Decode reads a prefill's host-tier blocks straight from its DRAM (issue #39): a handle's
``host_slots``, the producer's second NIXL registration, one READ per memory kind, and the
checks a handle of both kinds passes at decode's boundary. Producer and consumer agents are
real NIXL/UCX agents in this process (the producer progresses from the test's loop)."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator

import msgspec
import pytest
import torch

from pdserve.common.engine.kv_cache import new_cache
from pdserve.common.engine.kv_layout import KVLayout
from pdserve.common.runtime import protocol as p
from pdserve.common.runtime.boundary import check_host_slots
from pdserve.common.transfer.kv_consumer import KVConsumer
from pdserve.common.transfer.kv_pulls import PullSpec
from pdserve.common.transfer.kv_transfer import KVProducer, KVTransferError
from pdserve.common.transfer.nixl_backend import start_pulls
from pdserve.services.decode.pullers import plan_pulls

# head-order device caches (as on CPU), a block-order tier of 4 slots (as TierBuffer's)
LAYOUT = KVLayout(
    num_blocks=8, num_layers=2, num_kv_heads=2, block_size=4, head_dim=8, dtype="float32"
)
HOST = msgspec.structs.replace(LAYOUT, num_blocks=4, order="block")
WAIT_S = 20.0


def handle(block_ids: list[int], host_slots: list[int], agent: str) -> p.KVHandle:
    return p.KVHandle(
        engine_id="prefill-0",
        epoch=1,
        layout=LAYOUT,
        block_ids=block_ids,
        host_slots=host_slots,
        num_tokens=len(block_ids) * LAYOUT.block_size,
        replicas=[p.Replica(agent_name=agent, side_channel="")],
        lease_deadline=time.time() + 30,
    )


def seeded(layout: KVLayout, seed: int) -> torch.Tensor:
    cache = new_cache(layout)
    cache.copy_(torch.randn(layout.shape, generator=torch.Generator().manual_seed(seed)))
    return cache


def test_pull_spec_parts_split_device_blocks_from_tier_slots() -> None:
    spec = PullSpec(0, [3, -1, 5, -1], [0, 1, 2, 3], [(0, 0, 2)], [-1, 2, -1, 0])
    assert spec.parts() == [(False, [3, 5], [0, 2]), (True, [2, 0], [1, 3])]
    assert PullSpec(0, [3], [0], [(0, 0, 2)]).parts() == [(False, [3], [0])]
    assert PullSpec(0, [-1], [0], [(0, 0, 2)], [1]).parts() == [(True, [1], [0])]


@pytest.mark.parametrize("consumer_tp", [1, 2])
def test_every_decode_rank_reads_each_tier_slot_from_the_tier(consumer_tp: int) -> None:
    """A TP-1 producer's handle of both kinds, planned for 1 or 2 decode ranks: each
    rank's specs carry the host slots of their blocks, so each part goes where it lives."""
    h = handle([3, -1, 5, -1], [-1, 2, -1, 0], "a")
    plan = plan_pulls(h, [10, 11, 12, 13], LAYOUT.num_kv_heads, consumer_tp, striped=False)
    for specs in plan:
        [spec] = specs
        assert spec.parts() == [(False, [3, 5], [10, 12]), (True, [2, 0], [11, 13])]


@pytest.mark.parametrize(
    ("block_ids", "host_slots", "why"),
    [
        ([3, -1], [-1, 2], None),
        ([3, -1], [2], "1 host slots for 2 blocks"),
        ([3, 4], [-1, 2], "names not exactly one place"),
        ([-1, -1], [-1, 2], "names not exactly one place"),
        ([3, -2], [-1, 2], "names not exactly one place"),
        ([-1, -1], [2, 2], "lists a block twice"),
        ([3, 3], [-1, -1], "lists a block twice"),
    ],
)
def test_a_handle_of_both_kinds_names_each_block_once(
    block_ids: list[int], host_slots: list[int], why: str | None
) -> None:
    found = check_host_slots(handle(block_ids, host_slots, "a"))
    assert found is None if why is None else why in (found or "")


Pair = tuple[KVProducer, KVConsumer, torch.Tensor, torch.Tensor]


@pytest.fixture
def pair() -> Iterator[Pair]:
    """A producer serving a seeded cache and a seeded tier, a consumer connected to it."""
    pytest.importorskip("nixl")
    tag = uuid.uuid4().hex[:8]
    cache, tier = seeded(LAYOUT, 1), seeded(HOST, 2)
    producer = KVProducer(engine_id="prefill-0", epoch=1, agent_name=f"p-{tag}", kv_cache=cache,
                          layout=LAYOUT, compat={}, host_cache=tier, host_layout=HOST)  # fmt: skip
    consumer = KVConsumer(agent_name=f"d-{tag}", kv_cache=new_cache(LAYOUT), layout=LAYOUT,
                          compat={}, capture_telemetry=True)  # fmt: skip
    try:
        consumer.connect(producer.handshake_reply)
        yield producer, consumer, cache, tier
    finally:
        consumer.close()
        producer.close()


def test_one_pull_reads_device_blocks_and_tier_slots_from_where_they_live(pair: Pair) -> None:
    """Blocks 3 and 5 from the producer's cache, slots 2 and 0 from its tier: one READ per
    memory kind, each of NIXL's own descriptors over that kind's registration (the tier's
    READ reads the slots, nothing was copied into the cache for it), bytes equal."""
    producer, consumer, cache, tier = pair
    h = handle([3, -1, 5, -1], [-1, 2, -1, 0], producer.agent_name)
    spec = PullSpec(0, h.block_ids, [0, 1, 2, 3], [(0, 0, 2)], h.host_slots)
    before = cache.clone()
    pulls = start_pulls(consumer, "r", h, [spec])
    deadline = time.monotonic() + WAIT_S
    while producer.poll_releases() or not all(consumer.poll(pull) for pull in pulls):
        assert time.monotonic() < deadline, "the pull did not finish in time"
    device, host = pulls
    # head-order consumer: one descriptor per (head, block), no two blocks adjacent
    assert (device.num_descriptors, host.num_descriptors) == (4, 4)
    assert (device.nixl_descriptors, host.nixl_descriptors) == (4, 4)
    assert device.num_bytes == host.num_bytes == 2 * LAYOUT.block_bytes
    got = consumer.kv_cache
    assert torch.equal(got[0], cache[3]) and torch.equal(got[2], cache[5])
    assert torch.equal(got[1], tier[2]) and torch.equal(got[3], tier[0])
    assert torch.equal(cache, before)  # the producer's cache untouched: slots read as they are


def test_a_producer_without_a_tier_keeps_its_payload_and_refuses_tier_slots() -> None:
    """No tier: the NIXL payload has no host fields at all (a consumer older than them
    reads it); a handle naming tier slots of it is refused by name, nothing posted."""
    pytest.importorskip("nixl")
    tag = uuid.uuid4().hex[:8]
    producer = KVProducer(engine_id="prefill-0", epoch=1, agent_name=f"p-{tag}",
                          kv_cache=seeded(LAYOUT, 1), layout=LAYOUT, compat={})  # fmt: skip
    consumer = KVConsumer(agent_name=f"d-{tag}", kv_cache=new_cache(LAYOUT), layout=LAYOUT,
                          compat={})  # fmt: skip
    try:
        payload = msgspec.msgpack.decode(producer.handshake_reply.payload)
        assert "host_base_address" not in payload and "host_num_slots" not in payload
        consumer.connect(producer.handshake_reply)
        h = handle([-1], [0], producer.agent_name)
        with pytest.raises(KVTransferError, match="refused, it serves no host tier"):
            consumer.start_pull("r", h, [0], from_host=True)
    finally:
        consumer.close()
        producer.close()


@pytest.mark.parametrize(
    ("slots", "runs"),
    [([0, 1, 2, 3], 1), ([2, 3, 0, 1], 2), ([3, 2, 1, 0], 4), ([1, 2, 0, 3], 3)],
)
def test_adjacent_tier_slots_are_read_as_one_descriptor(slots: list[int], runs: int) -> None:
    """The tier pull into a block-order decode cache (as on a GPU at equal TP): slots
    adjacent in the tier and blocks adjacent in the cache are one descriptor (NIXL's own
    count), others apart; the bytes equal the slots', and the pull reports its tier part
    (bytes, seconds: the tier pull's GB/s in bench serve)."""
    pytest.importorskip("nixl")
    from pdserve.common.transfer.nixl_backend import pull_stats

    tag = uuid.uuid4().hex[:8]
    block_order = msgspec.structs.replace(LAYOUT, order="block")
    tier = seeded(HOST, 3)
    producer = KVProducer(engine_id="prefill-0", epoch=1, agent_name=f"p-{tag}",
                          kv_cache=seeded(block_order, 1), layout=block_order, compat={},
                          host_cache=tier, host_layout=HOST)  # fmt: skip
    consumer = KVConsumer(agent_name=f"d-{tag}", kv_cache=new_cache(block_order),
                          layout=block_order, compat={}, capture_telemetry=True)  # fmt: skip
    try:
        consumer.connect(producer.handshake_reply)
        h = msgspec.structs.replace(handle([-1] * 4, slots, producer.agent_name),
                                    layout=block_order)  # fmt: skip
        spec = PullSpec(0, h.block_ids, [4, 5, 6, 7], [(0, 0, 2)], h.host_slots)
        pulls = start_pulls(consumer, "r", h, [spec])
        deadline = time.monotonic() + WAIT_S
        while producer.poll_releases() or not all(consumer.poll(pull) for pull in pulls):
            assert time.monotonic() < deadline, "the pull did not finish in time"
        [pull] = pulls
        assert pull.from_host
        assert (pull.num_descriptors, pull.nixl_descriptors) == (runs, runs)
        got = consumer.kv_cache
        for k, slot in enumerate(slots):
            assert torch.equal(got[4 + k], tier[slot])
        num_bytes, _, _, host_bytes, host_seconds = pull_stats(pulls)
        assert num_bytes == host_bytes == 4 * block_order.block_bytes and host_seconds > 0
    finally:
        consumer.close()
        producer.close()
