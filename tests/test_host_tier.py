"""The host tier under the prefix cache (common/engine/host_tier.py): the pool's index of it
(pure) and an engine on a tiny random Llama whose device pool is too small to keep a
prompt's prefix, so that the prefix comes back from the tier."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from pdserve.common.engine.block_pool import BlockPool, hash_blocks
from pdserve.common.engine.config import EngineConfig
from pdserve.common.engine.host_tier import HostTier
from pdserve.common.engine.llm_engine import LLMEngine
from pdserve.common.engine.sampling_params import SamplingParams
from pdserve.common.errors import PdserveError
from pdserve.common.model.fixtures.random import save_random_llama

B = 4


class Recorder:
    """A TierMover that records the copies it is asked for."""

    block_bytes = 100

    def __init__(self) -> None:
        self.copies: list[tuple[str, int, int]] = []

    def copy_down(self, block: int, slot: int) -> None:
        self.copies.append(("down", block, slot))

    def copy_up(self, slot: int, block: int) -> None:
        self.copies.append(("up", slot, block))

    def flush(self) -> None:
        self.copies.append(("flush", -1, -1))


def cached_pool(num_blocks: int, num_slots: int) -> tuple[BlockPool, Recorder]:
    pool = BlockPool(num_blocks)
    mover = Recorder()
    pool.tier = HostTier(num_slots, mover)
    return pool, mover


def fill(pool: BlockPool, hashes: list[bytes]) -> list[int]:
    """Blocks computed for ``hashes``, registered and freed (cached, unreferenced)."""
    blocks = pool.allocate(len(hashes))
    for block, h in zip(blocks, hashes, strict=True):
        pool.register(block, h)
    pool.free(blocks)
    return blocks


def test_an_evicted_block_is_copied_down_and_comes_back_up() -> None:
    pool, mover = cached_pool(num_blocks=2, num_slots=4)
    a = hash_blocks(list(range(2 * B)), B)
    blocks = fill(pool, a)
    pool.allocate(2)  # evicts both cached blocks: each copied down once
    assert [c[0] for c in mover.copies] == ["down", "down"]
    assert {c[1] for c in mover.copies} == set(blocks)
    assert pool.tier is not None and pool.tier.num_blocks == 2
    assert pool.count_cached_prefix(a) == 0
    pool.free([0, 1])
    held = pool.hold_prefix(a)
    assert len(held) == 2 and [c[0] for c in mover.copies[2:]] == ["up", "up"]
    assert pool.match_prefix(a) == held  # now device hits
    pool.drop(held)
    assert [pool.ref_count(b) for b in held] == [1, 1]
    assert pool.tier.num_hits == 2


def test_the_tier_never_holds_a_block_twice_and_recycles_least_recent_first() -> None:
    pool, mover = cached_pool(num_blocks=2, num_slots=2)
    tier = pool.tier
    assert tier is not None
    a, b = hash_blocks(list(range(B)), B), hash_blocks(list(range(100, 100 + B)), B)
    fill(pool, a + b)
    pool.free(pool.allocate(2))  # a and b go down
    assert tier.num_offloaded == 2
    pool.drop(pool.hold_prefix(a))  # a comes back up, stays in the tier (inclusive)
    pool.free(pool.allocate(2))  # a evicted again: already held, nothing copied
    assert tier.num_offloaded == 2 and tier.num_blocks == 2
    assert sorted(tier.slot_of(h) for h in a + b) == [0, 1]  # type: ignore[type-var]
    c = hash_blocks(list(range(200, 200 + B)), B)
    fill(pool, c)
    pool.allocate(2)  # c goes down into b's slot: b is the least recently used
    assert c[0] in tier and a[0] in tier and b[0] not in tier
    assert tier.num_blocks == 2


def test_a_held_prefix_never_evicts_itself() -> None:
    """Bringing a tier hit up takes a device block; the run's earlier blocks are held, so
    that allocation cannot evict them (the prefix would break in the middle)."""
    pool, _ = cached_pool(num_blocks=3, num_slots=8)
    hashes = hash_blocks(list(range(3 * B)), B)
    fill(pool, hashes)
    pool.free(pool.allocate(3))  # all three down
    pool.drop(pool.hold_prefix(hashes[:1]))  # h0 up into block 0: the least recent now
    fill(pool, hash_blocks(list(range(500, 500 + 2 * B)), B))  # blocks 1, 2: more recent
    held = pool.hold_prefix(hashes)
    assert held[0] == 0 and sorted(held) == [0, 1, 2]
    assert pool.match_prefix(hashes) == held
    pool.drop(held)


def test_reset_and_clear_forget_everything() -> None:
    pool, _ = cached_pool(num_blocks=1, num_slots=2)
    tier = pool.tier
    assert tier is not None
    fill(pool, hash_blocks(list(range(B)), B))
    pool.free(pool.allocate(1))
    assert tier.num_blocks == 1
    pool.reset_prefix_cache()
    assert tier.num_blocks == 0 and pool.hold_prefix(hash_blocks(list(range(B)), B)) == []


def test_a_pinned_slot_is_never_recycled_until_its_last_unpin() -> None:
    """A pin (a lease a consumer may READ the slot under) keeps the slot and its bytes:
    recycling takes the least recent unpinned slot, and with every slot pinned an evicted
    block is forgotten without a copy; pins count, and one unpin too many is an error."""
    tier = HostTier(2, Recorder())
    mover = tier.mover
    assert isinstance(mover, Recorder)
    a, b, c, d = (hash_blocks(list(range(k, k + B)), B)[0] for k in (0, 100, 200, 300))
    assert tier.offload(0, [a]) == 0 and tier.offload(1, [b]) == 1
    assert tier.pin(c) is None  # not held: nothing to pin
    slot_a = tier.pin(a)
    assert slot_a == 0 and tier.pin(a) == 0 and tier.num_pinned == 1  # two pins, one slot
    tier.touch(1)  # b most recent: a would be recycled first, were it not pinned
    assert tier.offload(2, [c]) == 1 and a in tier and b not in tier
    tier.pin(c)
    assert tier.offload(3, [d]) is None and d not in tier  # every slot pinned
    assert ("down", 3, 0) not in mover.copies and ("down", 3, 1) not in mover.copies
    tier.unpin(slot_a)
    assert a in tier and tier.offload(3, [d]) is None  # a still pinned once
    tier.unpin(slot_a)
    assert tier.offload(3, [d]) == 0 and a not in tier and mover.copies[-1] == ("down", 3, 0)
    with pytest.raises(RuntimeError, match="slot 0 unpinned more often than pinned"):
        tier.unpin(0)


def test_clear_keeps_a_pinned_slot_until_it_is_unpinned_once() -> None:
    """A reset forgets a pinned block's hash but not its slot: nothing is written there
    until the reader's unpin, which frees it exactly once."""
    tier = HostTier(2, Recorder())
    a, b, c, d = (hash_blocks(list(range(k, k + B)), B)[0] for k in (0, 100, 200, 300))
    tier.offload(0, [a])
    slot = tier.pin(a)
    assert slot == 0
    tier.clear()
    assert a not in tier and tier.num_blocks == 0 and tier.num_pinned == 1
    assert tier.offload(1, [b]) == 1
    assert tier.offload(2, [c]) == 1 and b not in tier  # recycles b's slot, not the read one
    tier.unpin(slot)
    assert tier.num_pinned == 0 and tier.offload(3, [d]) == 0  # free again, once
    with pytest.raises(RuntimeError):
        tier.unpin(slot)
    tier.clear()
    assert [tier.offload(k, [h]) for k, h in enumerate((a, b))] == [0, 1]


def test_random_traffic_keeps_the_tier_consistent() -> None:
    """Seeded random prompts through a pool of 6 blocks over a tier of 5 slots: every hash
    in at most one slot, no slot named by two blocks, the tier never over its size, and
    every device block freed exactly once in the end."""
    import random

    class Contents(Recorder):
        """What each device block and slot holds: the hash of the tokens written there."""

        def __init__(self) -> None:
            super().__init__()
            self.device: dict[int, bytes] = {}
            self.slots: dict[int, bytes] = {}

        def copy_down(self, block: int, slot: int) -> None:
            super().copy_down(block, slot)
            self.slots[slot] = self.device[block]

        def copy_up(self, slot: int, block: int) -> None:
            super().copy_up(slot, block)
            self.device[block] = self.slots[slot]

    rng = random.Random(7)
    pool = BlockPool(6)
    mover = Contents()
    tier = pool.tier = HostTier(5, mover)
    prompts = [hash_blocks([rng.randrange(4) for _ in range(3 * B)], B) for _ in range(6)]
    for _ in range(300):
        hashes = rng.choice(prompts)[: rng.randrange(1, 4)]
        held = pool.hold_prefix(hashes)
        blocks = pool.match_prefix(hashes)
        pool.drop(held)
        # a prefix hit, from the device or the tier, holds the K/V of its own tokens
        assert [mover.device[b] for b in blocks] == hashes[: len(blocks)]
        grow = min(len(hashes) - len(blocks), pool.num_free_blocks)
        new = pool.allocate(grow)
        for block, h in zip(new, hashes[len(blocks) :], strict=False):
            mover.device[block] = h  # the step computes it
            pool.register(block, h)
        pool.free(blocks + new)
        slots = [tier.slot_of(h) for h in tier._slot_of]
        assert tier.num_blocks <= tier.num_slots
        assert set(slots) == set(tier._used) and len(tier._free) + tier.num_blocks == 5
        for slot, names in tier._used.items():
            assert all(tier.slot_of(h) == slot for h in names) and mover.slots[slot] in names
    assert pool.num_free_blocks == pool.num_blocks
    downs = [(b, s) for kind, b, s in mover.copies if kind == "down"]
    assert tier.num_offloaded == len(downs) > 0 and tier.num_hits > 0


# -- an engine ----------------------------------------------------------------------------

GREEDY = SamplingParams(max_tokens=4, ignore_eos=True)
PROMPT_A = list(range(5, 5 + 6 * B + 1))  # 6 full blocks and one token
FILLERS = [list(range(100 + 40 * i, 100 + 40 * i + 6 * B + 1)) for i in range(2)]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_random_llama(tmp_path_factory.mktemp("tier") / "llama", hidden_size=64,
                             num_heads=4, num_kv_heads=2, intermediate_size=128,
                             vocab_size=2048)  # fmt: skip


def engine(model: Path, tier_gb: float, kv_order: str = "auto") -> LLMEngine:
    # 9 blocks: one 25-token request at a time fits, the next prompt evicts its prefix
    return LLMEngine(EngineConfig(model=str(model), block_size=B, num_kv_blocks=9,
                                  kv_host_cache_gb=tier_gb, kv_order=kv_order))  # fmt: skip


def turns(eng: LLMEngine) -> list[tuple[list[int], int]]:
    """A, two other prompts that push A's blocks out of the device pool, A again."""
    out = []
    for prompt in (PROMPT_A, *FILLERS, PROMPT_A):
        [done] = eng.generate([prompt], GREEDY)
        out.append((done.token_ids, done.num_cached_tokens))
    return out


@pytest.mark.parametrize("kv_order", ["head", "block"])
def test_a_prefix_evicted_to_the_tier_gives_the_same_greedy_tokens(
    tiny: Path, kv_order: str
) -> None:
    """The tier's slots are block-major whatever the cache's order (tier_buffer.py)."""
    plain = engine(tiny, 0.0, kv_order)
    tiered = engine(tiny, 0.001, kv_order)  # ~1 MiB: every block of these prompts
    expected, got = turns(plain), turns(tiered)
    assert [t for t, _ in got] == [t for t, _ in expected]
    assert expected[-1][1] == 0  # without the tier A's prefix was lost
    assert got[-1][1] == 6 * B  # with it, every full block of A is cached (tier hits)
    tier = tiered.pool.tier
    assert tier is not None and tier.num_hits >= 6
    # a block a request still references is never recycled; nothing is held twice
    assert tier.num_blocks == len({tier.slot_of(h) for h in tier._slot_of})
    assert tiered.pool.num_free_blocks == tiered.pool.num_blocks
    tiered.close()
    assert tiered.pool.tier is None and tier.num_blocks == 0


def test_a_tier_too_small_for_one_block_is_refused(tiny: Path) -> None:
    with pytest.raises(PdserveError, match="holds no KV block"):
        engine(tiny, 1e-9)
    with pytest.raises(PdserveError, match="kv_host_cache_gb must be 0"):
        EngineConfig(kv_host_cache_gb=-1)
    with pytest.raises(PdserveError, match="kv_host_tier_serve must be auto, device or host"):
        EngineConfig(kv_host_tier_serve="dram")


def test_decode_reads_tier_blocks_from_the_tier_on_cpu_and_from_the_device_on_cuda() -> None:
    """kv_host_tier_serve auto: a CUDA prefill's tier blocks reach decode through its GPU
    (brought up at PCIe speed for its own step; a VRAM READ), a CPU one's from the tier."""
    assert EngineConfig().serves_host_tier
    assert not EngineConfig(device="cuda").serves_host_tier
    assert EngineConfig(device="cuda", kv_host_tier_serve="host").serves_host_tier
    assert not EngineConfig(kv_host_tier_serve="device").serves_host_tier


def test_the_tier_size_comes_from_toml_then_env_then_the_up_flag(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from pdserve.cli.main import build_parser
    from pdserve.cli.up import _engine_flags
    from pdserve.common.runtime.service_config import load_config

    toml = tmp_path / "pd.toml"
    toml.write_text("[engine]\nkv_host_cache_gb = 4\n")
    assert load_config(toml).engine.kv_host_cache_gb == 4
    assert load_config().engine.kv_host_cache_gb == 0  # off unless asked for
    monkeypatch.setenv("PDSERVE_ENGINE__KV_HOST_CACHE_GB", "2.5")
    assert load_config(toml).engine.kv_host_cache_gb == 2.5
    args = build_parser().parse_args(["up", "--kv-host-cache-gb", "8"])
    flags = _engine_flags(args)
    assert flags == {"kv_host_cache_gb": 8.0}
    assert load_config(toml, engine=flags).engine.kv_host_cache_gb == 8


# -- the router's prefix affinity ---------------------------------------------------------


def test_router_affinity_counts_likely_tier_blocks_less() -> None:
    import time

    from pdserve.services.router.links import HOST_TIER_WEIGHT, Link, pick

    def link(index: int, num_kv_blocks: int, num_host_blocks: int) -> Link:
        return Link(role="prefill", index=index, address="", sock=None, ready=True,
                    last_pong=time.monotonic(), num_kv_blocks=num_kv_blocks,
                    num_host_blocks=num_host_blocks)  # fmt: skip

    prompt = hash_blocks(list(range(8 * B)), B)
    others = [hash_blocks(list(range(1000 * i, 1000 * i + 4 * B)), B) for i in range(1, 4)]
    tiered = link(0, num_kv_blocks=8, num_host_blocks=8)
    tiered.remember(prompt)
    assert tiered.prefix_score(prompt) == 8  # still on the device
    for hashes in others[:2]:
        tiered.remember(hashes)  # 8 blocks later: the prompt's went down to the tier
    assert tiered.prefix_score(prompt) == 8 * HOST_TIER_WEIGHT
    tiered.remember(others[2])  # 4 more: its first 4 blocks fell out of the tier as well
    assert tiered.prefix_score(prompt) == 0
    fresh = link(1, num_kv_blocks=8, num_host_blocks=8)
    fresh.remember(prompt[:6])  # 6 blocks on the device beat 8 in a tier (4 points)
    older = link(2, num_kv_blocks=8, num_host_blocks=8)
    older.remember(prompt)
    for hashes in others[:2]:
        older.remember(hashes)
    assert pick([older, fresh], prompt) is fresh
    plain = link(3, num_kv_blocks=8, num_host_blocks=0)  # no tier: every remembered block
    plain.remember(prompt)
    for hashes in others:
        plain.remember(hashes)
    assert plain.prefix_score(prompt) == plain.cached_prefix(prompt) == 8


def test_a_tier_on_an_engine_of_several_ranks_is_refused_at_load() -> None:
    from pdserve.common.runtime.service_config import load_config

    with pytest.raises(PdserveError, match="decode has 2 ranks"):
        load_config(decode_tp=2, engine={"kv_host_cache_gb": 1})
    # the role of several ranks without a tier, the other with one: fine
    cfg = load_config(pcp=2, engine={"kv_host_cache_gb": 1}, prefill_engine={"kv_host_cache_gb": 0})
    assert cfg.engine_for("decode").kv_host_cache_gb == 1


@pytest.mark.slow
@pytest.mark.parametrize(
    ("colocated", "serve"),
    [(False, "auto"), (True, "auto"), (False, "device")],
    ids=["disaggregated", "colocated", "disaggregated-from-device"],
)
def test_a_deployment_serves_second_turns_from_the_tier(
    model_dir: Path, tmp_path: Path, colocated: bool, serve: str
) -> None:
    """Real processes: 4 users' first turns (3 blocks each) overflow pools of 8 blocks, so
    the second turns find their first prompts in the host tier of the engine that computes
    prompts: every full block of them counted in usage's cached_tokens, the hits in
    /metrics. Disaggregated, decode reads those blocks from the prefill's tier (auto on
    CPU), or from its device cache, where the prefill brought them up (``device``: staged
    through the producer's device, as auto does on CUDA; no tier READ)."""
    import json
    import re
    import urllib.request

    from pdserve.cli.main import main
    from tests.e2e import deployment

    out = tmp_path / "chat.json"
    engine = {"block_size": 16, "num_kv_blocks": 8, "kv_host_cache_gb": 0.01,
              "kv_host_tier_serve": serve}  # fmt: skip
    with deployment(tmp_path / "dep", model_dir, engine=engine, colocated=colocated) as dep:
        rc = main(["bench", "serve", "--url", dep.url, "--num-prompts", "8", "--multi-turn",
                   "2", "--input-len", "48", "--output-len", "4", "--max-concurrency", "1", "--num-warmups", "0",
                   "--json", str(out)])  # fmt: skip
        with urllib.request.urlopen(f"{dep.url}/metrics", timeout=30) as resp:
            text = resp.read().decode()
    assert rc == 0
    [run] = json.loads(out.read_text())["runs"]
    assert run["metrics"]["failed"] == 0
    assert run["metrics"]["cached_prompt_tokens"] == 4 * 48  # each first prompt, whole
    service = "decode" if colocated else "prefill"
    pattern = rf'^pdserve:kv_host_cache_hits_total\{{[^}}]*service="{service}"[^}}]*\}} (\S+)'
    hits = re.findall(pattern, text, re.MULTILINE)
    assert hits and float(hits[0]) > 0
    pattern = r'^pdserve:kv_host_cache_served_total\{[^}]*service="prefill"[^}]*\} (\S+)'
    served = [float(v) for v in re.findall(pattern, text, re.MULTILINE)]
    pulled = run["metrics"]["tier_pull_bytes"]  # the tier READs' bytes (bench serve's)
    if not colocated and serve == "auto":  # published by tier slot: decode read host DRAM
        assert served and served[0] > 0
        assert pulled and run["metrics"]["tier_pull_gbps"] > 0
    elif not colocated:  # read from the prefill's device: no slot served, no tier READ
        assert served == [0.0] and pulled is None
    assert re.search(r"^pdserve:kv_host_cache_offload_bytes_total\{", text, re.MULTILINE)


@pytest.mark.slow
def test_prefill_killed_before_decode_reads_its_tier_blocks(
    model_dir: Path, tmp_path: Path
) -> None:
    """The fault suite's kill of a prefill between its answer and the pull, with the answer's
    prefix published from the prefill's host tier (tier slots pinned under the lease): the
    request fails naming the producer, nothing is left held on decode, and the restarted
    prefill serves the same prompt with every pool back to full."""
    import concurrent.futures

    from pdserve.common.runtime.fault_hooks import HOLD_PULLS_ENV
    from tests.e2e import deployment
    from tests.fault_suite import (
        DETECT_BOUND,
        FAST,
        addresses,
        client,
        decode_waiting,
        failure_of,
        in_background,
        restart,
    )
    from tests.fault_tools import pools_full, service_metrics, wait_until

    def served() -> float:
        metrics = service_metrics(dep.cfg.prefill_addresses[0].address, "prefill")
        return metrics.get("pdserve:kv_host_cache_served", 0.0)

    hold = tmp_path / "hold-pulls"
    engine = {"block_size": 16, "num_kv_blocks": 8, "kv_host_cache_gb": 0.01}
    first, *others = [list(range(1000 * k, 1000 * k + 48)) for k in range(1, 5)]  # 3 blocks each
    second = first + list(range(9000, 9016))
    with deployment(tmp_path / "dep", model_dir, engine=engine,
                    env={HOLD_PULLS_ENV: str(hold)}, **FAST) as dep:  # fmt: skip
        with client(dep) as c:  # the first prompt, then three more that push it to the tier
            for ids in [first, *others]:
                assert c.generate(prompt_token_ids=ids, max_tokens=2).token_ids
        before = served()
        hold.touch()
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            fut = in_background(pool, dep, second, max_tokens=4)
            wait_until(lambda: decode_waiting(dep), 30, "decode to hold the pull")
            assert served() > before  # the handle names tier slots, pinned under its lease
            dep.kill("prefill-0")
            hold.unlink()
            err = failure_of(fut, DETECT_BOUND)
        assert err.reason == "kv_transfer" and "prefill-0" in err.message, err
        restart(dep, "prefill-0")
        with client(dep) as c:
            assert len(c.generate(prompt_token_ids=second, max_tokens=4).token_ids) == 4
        wait_until(lambda: pools_full(addresses(dep)), 15, "every pool back to full")


def test_a_sequence_evicted_together_takes_adjacent_slots_in_its_order() -> None:
    """A sequence is evicted tail first (the pool frees it in reverse), but goes down in
    sequence order: its blocks take ascending adjacent slots, so decode reading them from
    the tier against its own adjacent blocks needs one descriptor, not one per block."""
    from pdserve.common.transfer.kv_descs import num_runs

    pool, mover = cached_pool(num_blocks=4, num_slots=8)
    tier = pool.tier
    assert tier is not None
    seq = hash_blocks(list(range(4 * B)), B)
    blocks = fill(pool, seq)
    pool.allocate(4)  # all four evicted in one allocation: tail first
    slots = [tier.slot_of(h) for h in seq]
    assert slots == [0, 1, 2, 3]
    assert [c[1] for c in mover.copies] == blocks  # copied down head first
    local = np.arange(10, 14)
    assert num_runs(np.array(slots), local) == 1
    # a second sequence through recycled slots keeps its order too
    pool.free(list(range(4)))
    other = hash_blocks(list(range(1000, 1000 + 4 * B)), B)
    fill(pool, other)  # evicts nothing: blocks were free, unregistered
    pool.allocate(4)
    slots = [tier.slot_of(h) for h in other]
    assert slots == [4, 5, 6, 7] and num_runs(np.array(slots), local) == 1
    third = hash_blocks(list(range(2000, 2000 + 4 * B)), B)
    pool.free(list(range(4)))
    fill(pool, third)
    pool.allocate(4)  # the tier is full: the least recent slots, seq's, recycled in order
    slots = [tier.slot_of(h) for h in third]
    assert slots == [0, 1, 2, 3] and num_runs(np.array(slots), local) == 1
