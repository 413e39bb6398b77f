"""Prefill and decode engine threads in one process, turned by hand, with the in-process
transfer backend (common/transfer/inprocess.py: real copies between the two engines'
caches, no NIXL, no sockets). A decode request waits for its KV in its scheduler
(WAITING_FOR_REMOTE_KV) while the pull runs; whatever ends it (pull done, failed, outlived
by its lease, aborted, released twice) every block of both pools is freed exactly once
(the pools' counts) and greedy tokens equal the monolithic engine's."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import pytest

from pdserve.common.engine.config import EngineConfig
from pdserve.common.engine.llm_engine import LLMEngine
from pdserve.common.engine.sampling_params import SamplingParams
from pdserve.common.model.fixtures.random import save_random_llama
from pdserve.common.runtime import protocol as p
from pdserve.common.runtime.engine_commands import Abort, Connected, Decode, Prefill, SideRelease
from pdserve.common.runtime.metrics import Metrics
from pdserve.common.runtime.service_config import DeploymentConfig
from pdserve.common.transfer.inprocess import InProcessConsumer
from pdserve.services.decode.engine_thread import DecodeContext, DecodeEngineThread
from pdserve.services.prefill.engine_thread import PrefillContext, PrefillEngineThread

B = 4
NUM_BLOCKS = 24
PROMPT = list(range(5, 19))  # 14 tokens: 4 blocks
GREEDY = SamplingParams(max_tokens=6, ignore_eos=True)
ENGINE = "prefill-0"


@pytest.fixture(scope="module")
def engine_config(tmp_path_factory: pytest.TempPathFactory) -> EngineConfig:
    path = save_random_llama(tmp_path_factory.mktemp("remote_kv") / "llama", hidden_size=64,
                             num_heads=4, num_kv_heads=2, intermediate_size=128,
                             vocab_size=2048)  # fmt: skip
    return EngineConfig(model=str(path), block_size=B, num_kv_blocks=NUM_BLOCKS)


@pytest.fixture(scope="module")
def reference(engine_config: EngineConfig) -> list[int]:
    [done] = LLMEngine(engine_config).generate([PROMPT], GREEDY)
    return done.token_ids


class Pair:
    """A prefill and a decode engine thread (never started: turned by hand), replies
    collected in place of the services' sockets."""

    def __init__(self, engine: EngineConfig, **cfg: Any) -> None:
        self.cfg = DeploymentConfig(
            model=engine.model, engine=engine, kv_transfer_backend="inprocess", **cfg
        )
        self.loop = asyncio.new_event_loop()
        self.replies: list[p.Message] = []
        self.side: list[tuple[str, p.Message]] = []
        self.handshakes: list[p.HandshakeReply] = []
        self.prefill = PrefillEngineThread(
            PrefillContext(
                cfg=self.cfg,
                instance=0,
                torch_threads=1,
                metrics=Metrics("prefill", 0),
                reply=self._reply,
                engine_id=ENGINE,
                epoch=1,
                side_channel="tcp://side:0",
                publish_handshakes=self.handshakes.extend,
            ),
            self.loop,
        )
        self.decode = DecodeEngineThread(
            DecodeContext(
                cfg=self.cfg,
                instance=0,
                torch_threads=1,
                metrics=Metrics("decode", 0),
                reply=self._reply,
                send_side=lambda address, msg: self.side.append((address, msg)),
            ),
            self.loop,
        )
        for thread in (self.prefill, self.decode):
            thread.post = lambda callback, *args: callback(*args)  # type: ignore[method-assign]
            thread.setup()
        assert isinstance(self.decode.puller, InProcessConsumer)
        self.consumer: InProcessConsumer = self.decode.puller
        self.decode.handlers[Connected](Connected(key=(ENGINE, 1), replies=self.handshakes))

    def _reply(self, identity: bytes, msg: p.Message) -> None:
        self.replies.append(msg)

    def close(self) -> None:
        for thread in (self.prefill, self.decode):
            thread.teardown()
        self.loop.close()

    def prefilled(
        self, rid: str, sampling: SamplingParams = GREEDY, prompt: list[int] = PROMPT
    ) -> p.PrefillDone:
        req = p.PrefillRequest(request_id=rid, trace_id=f"t-{rid}", prompt_token_ids=prompt,
                               sampling=sampling)  # fmt: skip
        self.prefill.handlers[Prefill](Prefill(identity=b"router", request=req))
        while not (done := [m for m in self.replies if isinstance(m, p.PrefillDone)
                            and m.request_id == rid]):  # fmt: skip
            self.prefill.run_once()
        return done[0]

    def send_decode(
        self, done: p.PrefillDone, sampling: SamplingParams = GREEDY, prompt: list[int] = PROMPT
    ) -> None:
        msg = p.DecodeRequest(request_id=done.request_id, trace_id=done.trace_id,
                              prompt_token_ids=prompt, sampling=sampling,
                              first_token=done.first_token, handle=done.handle)  # fmt: skip
        self.decode.handlers[Decode](Decode(identity=b"router", request=msg))

    def turn(self, times: int = 1) -> None:
        for _ in range(times):
            self.decode.run_once()
            self.prefill.run_once()

    def run_until_terminal(self, rid: str) -> p.Message:
        for _ in range(100):
            if terminal := self.terminal(rid):
                self.turn(3)  # the producer takes the release
                return terminal[0]
            self.turn()
        raise AssertionError(f"{rid} never ended: {self.replies}")

    def terminal(self, rid: str) -> list[p.Message]:
        return [m for m in self.replies if isinstance(m, p.Finished | p.Failed)
                and m.request_id == rid]  # fmt: skip

    def tokens(self, rid: str) -> list[int]:
        return [t for m in self.replies if isinstance(m, p.TokenChunk) and m.request_id == rid
                for t in m.token_ids]  # fmt: skip

    def assert_every_block_free(self) -> None:
        for pool in (self.prefill.engine.pool, self.decode.engine.pool):
            assert pool.num_free_blocks == pool.num_blocks
        assert len(self.prefill.leases) == 0 and not self.prefill.engine.scheduler.pinned
        assert not self.decode.engine.scheduler.waiting_for_remote_kv and not len(self.decode.pulls)


@pytest.fixture
def pair(engine_config: EngineConfig) -> Iterator[Pair]:
    made = Pair(engine_config)
    yield made
    made.close()


def test_a_pulled_request_decodes_the_monolithic_tokens(pair: Pair, reference: list[int]) -> None:
    done = pair.prefilled("a")
    assert pair.prefill.engine.pool.num_free_blocks == NUM_BLOCKS - 4  # pinned for the pull
    pair.send_decode(done)
    assert "a" in pair.decode.engine.scheduler.waiting_for_remote_kv
    finished = pair.run_until_terminal("a")
    assert isinstance(finished, p.Finished) and finished.finish_reason == "length"
    assert [done.first_token, *pair.tokens("a")[1:]] == pair.tokens("a") == reference
    assert pair.decode.metrics.value("pdserve:kv_transfers") == 1
    assert pair.prefill.metrics.value("pdserve:kv_replica_releases", rank=0) == 1
    pair.assert_every_block_free()


def test_a_release_delivered_twice_frees_the_producer_blocks_once(pair: Pair) -> None:
    done = pair.prefilled("a")
    pair.send_decode(done)
    pair.run_until_terminal("a")
    assert pair.consumer.release(done.handle, "a", "t-a") == []  # the same release again
    release = p.Release(request_id="a", engine_id=ENGINE, epoch=1, token=done.handle.token)
    pair.prefill.handlers[SideRelease](SideRelease(release=release))  # and by the side channel
    pair.turn(2)
    pair.assert_every_block_free()


def test_a_failed_pull_fails_the_request_and_frees_both_sides(pair: Pair) -> None:
    done = pair.prefilled("a")
    pair.consumer.fail["a"] = "injected READ failure"
    pair.send_decode(done)
    failed = pair.run_until_terminal("a")
    assert isinstance(failed, p.Failed) and failed.reason == "kv_transfer"
    assert "injected READ failure" in failed.message
    pair.assert_every_block_free()


def test_a_failed_pull_recomputes_the_same_tokens(
    engine_config: EngineConfig, reference: list[int]
) -> None:
    pair = Pair(engine_config, kv_load_failure_policy="recompute")
    try:
        done = pair.prefilled("a")
        pair.consumer.fail["a"] = "injected READ failure"
        pair.send_decode(done)
        assert isinstance(pair.run_until_terminal("a"), p.Finished)
        assert pair.tokens("a") == reference
        pair.assert_every_block_free()
    finally:
        pair.close()


def host_tier(gigabytes: float) -> dict[str, Any]:
    """Overrides giving both engines a host tier (common/engine/host_tier.py); 0: none."""
    if not gigabytes:
        return {}
    tier = {"kv_host_cache_gb": gigabytes}
    return {"prefill_engine": tier, "decode_engine": tier}


def with_a_block_in_the_tier(engine_config: EngineConfig, **cfg: Any) -> Pair:
    """A pair whose prefill pool of 6 blocks lost the tail of PROMPT's cached prefix to
    another prompt: PROMPT again finds 2 blocks on the device and 1 in the tier."""
    pair = Pair(
        engine_config, prefill_engine={"num_kv_blocks": 6, "kv_host_cache_gb": 0.001}, **cfg
    )
    other = list(range(300, 314))
    for rid, prompt in (("a", PROMPT), ("b", other)):
        pair.send_decode(pair.prefilled(rid, prompt=prompt), prompt=prompt)
        assert isinstance(pair.run_until_terminal(rid), p.Finished)
    tier = pair.prefill.engine.pool.tier
    assert tier is not None and tier.num_offloaded == 1 and tier.num_hits == 0
    return pair


def test_a_prefix_half_in_the_host_tier_pulls_the_monolithic_tokens(
    engine_config: EngineConfig, reference: list[int]
) -> None:
    """PROMPT's tier block is copied up for prefill's own step; its PrefillDone names that
    block by its tier slot (pinned under the lease; the device block back in the pool at
    once), and decode's one pull reads 3 device blocks and the tier slot: the monolithic
    tokens."""
    pair = with_a_block_in_the_tier(engine_config)
    tier = pair.prefill.engine.pool.tier
    assert tier is not None
    try:
        done = pair.prefilled("again")
        assert done.num_cached_tokens == 3 * B and tier.num_hits == 1
        handle = done.handle
        [at] = [i for i, s in enumerate(handle.host_slots) if s >= 0]
        slot = handle.host_slots[at]
        assert at == 2 and handle.block_ids[at] == -1 and tier.hashes_of(slot)
        assert tier.num_pinned == 1  # pinned under the lease: never recycled meanwhile
        assert pair.prefill.engine.pool.num_free_blocks == 6 - 3  # 3 device blocks pinned
        pair.send_decode(done)
        assert isinstance(pair.run_until_terminal("again"), p.Finished)
        assert pair.tokens("again") == reference
        assert pair.consumer.num_host_blocks_read == 1  # read from the slot, not a device copy
        assert tier.num_pinned == 0  # the release unpinned it
        pair.assert_every_block_free()
        metric = pair.prefill.metrics.value
        assert metric("pdserve:kv_host_cache_hits") == 1
        # bringing the block up took a device block: one of b's went down for it
        assert metric("pdserve:kv_host_cache_blocks") == tier.num_blocks == 2
        block_bytes = pair.prefill.engine.runner.layout.block_bytes
        assert metric("pdserve:kv_host_cache_offload_bytes") == 2 * block_bytes
        assert metric("pdserve:kv_host_cache_reload_bytes") == block_bytes
        assert metric("pdserve:kv_host_cache_served") == 1
    finally:
        pair.close()
    assert pair.prefill.engine.pool.tier is None  # teardown gave the tier back


def test_a_lease_that_expires_unpins_its_tier_slots_once(engine_config: EngineConfig) -> None:
    """The lease of a handle naming a tier slot runs out while the pull is held: the slot
    is unpinned with the device blocks, once (a second unpin would raise), and the late
    release is a no-op; the slot is recycled like any other after that."""
    pair = with_a_block_in_the_tier(engine_config, lease_seconds=0.2, heartbeat_seconds=0.1)
    tier = pair.prefill.engine.pool.tier
    assert tier is not None
    try:
        done = pair.prefilled("again")
        assert tier.num_pinned == 1 and max(done.handle.host_slots) >= 0
        pair.consumer.hold.add("again")
        pair.send_decode(done)
        pair.turn()
        time.sleep(0.3)
        pair.turn()  # the lease expires: blocks and the slot unpinned
        assert pair.prefill.metrics.value("pdserve:kv_expired_requests", rank=0) == 1
        assert tier.num_pinned == 0
        assert pair.prefill.engine.pool.num_free_blocks == 6
        pair.consumer.hold.clear()
        assert isinstance(pair.run_until_terminal("again"), p.Finished)  # late release: no-op
        assert tier.num_pinned == 0
        pair.assert_every_block_free()
    finally:
        pair.close()


@pytest.mark.parametrize("tier_gb", [0, 0.001], ids=["no_tier", "host_tier"])
def test_a_pull_outlived_by_its_lease_frees_each_block_once(
    engine_config: EngineConfig, tier_gb: float
) -> None:
    pair = Pair(engine_config, lease_seconds=0.2, heartbeat_seconds=0.1, **host_tier(tier_gb))
    try:
        done = pair.prefilled("a")
        pair.consumer.hold.add("a")  # the pull stays in flight past the producer's lease
        pair.send_decode(done)
        pair.turn()
        assert len(pair.decode.engine.scheduler.waiting_for_remote_kv["a"].held_block_ids) == 4
        time.sleep(0.3)
        pair.turn()  # the lease expires: the producer unpins once
        assert pair.prefill.metrics.value("pdserve:kv_expired_requests", rank=0) == 1
        assert pair.prefill.engine.pool.num_free_blocks == NUM_BLOCKS
        pair.consumer.hold.clear()
        assert isinstance(pair.run_until_terminal("a"), p.Finished)  # its late release: a no-op
        pair.assert_every_block_free()
    finally:
        pair.close()


@pytest.mark.parametrize("when", ["before_the_handshake", "waiting_for_blocks", "mid_pull"])
def test_an_aborted_request_frees_its_blocks_once(engine_config: EngineConfig, when: str) -> None:
    # waiting for blocks: a decode cache of 6 blocks, 4 held by another request's pull
    small = {"decode_engine": {"num_kv_blocks": 6}} if when == "waiting_for_blocks" else {}
    pair = Pair(engine_config, **small)
    try:
        if when == "waiting_for_blocks":
            pair.send_decode(pair.prefilled("other"))
            pair.turn()
        done = pair.prefilled("a")
        if when == "before_the_handshake":
            pair.decode.pulls.producers.clear()  # as if the producer's handshake were not back yet
        if when == "mid_pull":
            pair.consumer.hold.add("a")
        pair.send_decode(done)
        pair.turn()
        waiting = pair.decode.engine.scheduler.waiting_for_remote_kv["a"]
        assert len(waiting.held_block_ids) == (4 if when == "mid_pull" else 0)
        pair.decode.handlers[Abort](Abort(request_id="a"))
        if when == "mid_pull":
            assert pair.terminal("a") == []  # a READ in flight cannot be recalled
            pair.consumer.hold.clear()
        aborted = pair.run_until_terminal("a")
        assert isinstance(aborted, p.Finished) and aborted.finish_reason == "abort"
        if when == "waiting_for_blocks":
            assert isinstance(pair.run_until_terminal("other"), p.Finished)
        pair.assert_every_block_free()
    finally:
        pair.close()
