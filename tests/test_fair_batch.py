"""Fair decode batches (#49, common/engine/fair_batch.py): the cap from a step-time curve
(a CPU-like curve that saturates gives one, a GPU-like flat one none), the scheduler's
pick under a cap (the other client's sequence in every step, the busy client's rotating,
none starved; one client: the full batch), and the engine on the tiny random model: the
same greedy tokens with the cap as without."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest

from pdserve.common.engine.block_pool import BlockPool
from pdserve.common.engine.config import EngineConfig
from pdserve.common.engine.fair_batch import DecodeCurve, ladder, parse_mode
from pdserve.common.engine.request import Request
from pdserve.common.engine.sampling import SamplingParams
from pdserve.common.engine.scheduler import Scheduler
from pdserve.common.errors import PdserveError

B = 4  # block size


def cpu_like(n: int) -> float:
    """Seconds a decode step of n takes on 2 CPU threads (benchmarks/README.md: ~65 ms at
    1, ~150 ms at 16, ~0.5 s at 56): throughput saturates by ~16."""
    return 0.06 + 0.0055 * n if n <= 16 else 0.148 + 0.0063 * (n - 16) + 0.00006 * (n - 16) ** 2


def gpu_like(n: int) -> float:
    """A step of 64 costs about a step of 1 (memory-bound): throughput ~ n."""
    return 0.020 + 0.00005 * n


def learned(curve: DecodeCurve, t: Callable[[int], float], n: int, steps: int = 400) -> int:
    """Run ``steps`` steps of ``n`` decoding, probes included; the probe steps taken."""
    probes = 0
    for _ in range(steps):
        size = curve.probe(n) or n
        probes += size != n
        curve.observe(size, t(size))
    return probes


def test_no_measurements_no_cap() -> None:
    curve = DecodeCurve(ladder(64))
    assert curve.cap(57) is None
    assert all(curve.probe(57) is None for _ in range(20))  # nothing probed before the full


def test_a_saturating_curve_caps_and_a_flat_one_does_not() -> None:
    cpu = DecodeCurve(ladder(64))
    probes = learned(cpu, cpu_like, 57)
    cap = cpu.cap(57)
    assert cap is not None and 8 <= cap <= 24, (cap, cpu.buckets)
    assert cpu_like(cap) <= 0.8 * cpu_like(57)
    assert cap / cpu_like(cap) >= 0.9 * 57 / cpu_like(57)  # of the full batch's throughput
    assert probes < 40  # the rungs, a few samples each (and refreshes)

    gpu = DecodeCurve(ladder(64, [1, 2, 4, 8, 16, 24, 32, 48, 64]))
    probes = learned(gpu, gpu_like, 57)
    assert gpu.cap(57) is None
    gpu.presence = 0.3  # another client decodes now and then: the lowest share asked (80%)
    assert gpu.share_asked() == 0.8 and gpu.cap(57) is None  # a step of 48 ~ one of 64
    assert probes <= 9  # a rung or two below the full batch, then the descent stops
    assert set(gpu.buckets) <= {32, 48, 64}

    small = DecodeCurve(ladder(64))
    learned(small, cpu_like, 6)
    assert small.cap(6) is None  # nothing to gain at a handful


def test_the_cap_in_use_holds_within_a_margin() -> None:
    """A bucket at 88.5% of the full batch's throughput: not taken as a new cap, kept as the
    current one (step times' noise does not flap it)."""
    curve = DecodeCurve(ladder(64))
    for _ in range(4):
        curve.observe(57, 0.232)  # 245.7 tokens/s
        curve.observe(48, 48 / (0.95 * 57 / 0.232))
        curve.observe(32, 32 / (0.885 * 57 / 0.232))
    assert curve.cap(57) is None
    curve.current = 32
    assert curve.cap(57) == 32


def test_the_share_asked_spends_the_budget_over_the_time_the_cap_costs() -> None:
    """A bucket at 86% of the full batch's throughput (issue 49's 24 on a 2-core CPU): not
    a cap while two clients always decode (90% asked), the cap when the other client
    decodes about half the time (the 10% budget over half the time: 80% asked)."""
    curve = DecodeCurve(ladder(64))

    for _ in range(4):  # the buckets' samples, while both decode
        curve.observe(48, 48 / (0.95 * 57 / 0.232))
        curve.observe(32, 32 / (0.91 * 57 / 0.232))
        curve.observe(24, 24 / (0.86 * 57 / 0.232))
        curve.observe(16, 16 / (0.72 * 57 / 0.232))  # under the descent: never a cap

    def steps(pattern: list[bool]) -> None:  # full-batch steps of 232 ms (245.7 tokens/s)
        for _ in range(300):
            for shared in pattern:
                curve.observe(57, 0.232, shared)

    steps([True])  # both decode all the time
    assert curve.presence > 0.99 and curve.share_asked() == pytest.approx(0.9, abs=1e-3)
    assert curve.cap(57) == 32
    steps([True, False])  # half the time
    assert 0.45 < curve.presence < 0.55 and curve.share_asked() == pytest.approx(0.8, abs=0.02)
    assert curve.cap(57) == 24
    steps([True, False, False, False, False])  # a fifth: no less than the descent's 80%
    assert curve.share_asked() == 0.8 and curve.cap(57) == 24
    fresh = DecodeCurve(ladder(64))
    assert fresh.presence == 1.0 and fresh.share_asked() == 0.9  # unseen: the full share


def test_the_cap_falls_on_a_graph_size() -> None:
    sizes = [1, 2, 4, 8, 16, 24, 32, 48, 64]
    curve = DecodeCurve(ladder(64, sizes))
    learned(curve, cpu_like, 60)
    assert curve.cap(60) in sizes


def test_mode_parsing() -> None:
    assert parse_mode("auto") == "auto" and parse_mode("OFF") == "off"
    assert parse_mode(16) == 16 and parse_mode("16") == 16
    for bad in (0, "0", "-1", "many", True):
        with pytest.raises(ValueError):
            parse_mode(bad)  # type: ignore[arg-type]
    assert EngineConfig(fair_decode_batch=8).fair_decode_batch == 8
    with pytest.raises(PdserveError):
        EngineConfig(fair_decode_batch="sometimes")


# -- the scheduler's pick -------------------------------------------------------------------


def decoding(s: Scheduler, demand: dict[str, int], max_tokens: int = 1000) -> list[Request]:
    """Each client's requests, prompts computed and in decode (one output token)."""
    reqs = []
    for client, num in demand.items():
        for k in range(num):
            req = Request(f"{client}{k}", [1, 2, 3], SamplingParams(max_tokens=max_tokens),
                          len(reqs), client=client)  # fmt: skip
            s.add(req)
            reqs.append(req)
    while any(not r.output_token_ids for r in reqs):
        run(s)
    return reqs


def run(s: Scheduler) -> list[Request]:
    """One step with a fake sampler; the requests that decoded in it."""
    plan, chosen = s.schedule()
    s.on_step_done(chosen, plan)
    for seq, req in zip(plan.seqs, chosen, strict=True):
        if seq.sample:
            req.output_token_ids.append(7)
    return chosen


def test_two_clients_b_in_every_step_a_rotates_none_starved() -> None:
    s = Scheduler(BlockPool(1024), B, 64, 2048)
    s.fair_decode_batch = 8
    reqs = decoding(s, {"a": 20, "b": 1})
    b = reqs[-1]
    counts: Counter[str] = Counter()
    gaps: dict[str, int] = {}
    last: dict[str, int] = {}
    for k in range(70):
        chosen = run(s)
        assert len(chosen) == 8 and s.decode_cap == 8
        assert b in chosen
        for req in chosen:
            counts[req.request_id] += 1
            if req.request_id in last:
                gaps[req.request_id] = max(gaps.get(req.request_id, 0), k - last[req.request_id])
            last[req.request_id] = k
    a_counts = [counts[f"a{k}"] for k in range(20)]
    assert counts["b0"] == 70
    # 7 seats a step for 20 sequences: each runs every 3rd step, evenly
    assert max(a_counts) - min(a_counts) <= 1, a_counts
    assert max(gaps[f"a{k}"] for k in range(20)) <= 3
    # every sequence kept its blocks while it waited
    assert all(r.block_ids for r in reqs)


def test_one_client_runs_its_full_batch() -> None:
    s = Scheduler(BlockPool(1024), B, 64, 2048)
    s.fair_decode_batch = 8
    decoding(s, {"a": 20})
    for _ in range(5):
        assert len(run(s)) == 20 and s.decode_cap is None


def test_auto_caps_by_the_curve_and_off_never() -> None:
    s = Scheduler(BlockPool(8192), B, 64, 2048)
    s.fair_decode_batch = "auto"
    s.decode_curve = DecodeCurve(ladder(64))
    reqs = decoding(s, {"a": 56, "b": 1})
    assert len(run(s)) == 57  # nothing measured: the full batch
    for _ in range(300):  # the engine core's part: each decode step timed on the curve
        chosen = run(s)
        s.decode_curve.observe(len(chosen), cpu_like(len(chosen)))
    cap = s.decode_curve.cap(57)
    assert cap is not None and cap < 57
    chosen = run(s)
    assert reqs[-1] in chosen and len(chosen) in (cap, 57)  # a probe may re-measure 57
    s.fair_decode_batch = "off"
    assert len(run(s)) == 57


# -- the engine: the same greedy tokens --------------------------------------------------


def tokens(model_dir: Path, **config: object) -> tuple[dict[str, list[int]], set[int | None]]:
    from pdserve.common.engine.llm_engine import LLMEngine

    engine = LLMEngine(EngineConfig(model=str(model_dir), kv_cache_memory_gb=0.05, **config))  # type: ignore[arg-type]
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    for k in range(7):
        engine.add_request(f"a{k}", [5 + k, 17, 99, 3 * k + 1], greedy, client="a")
    engine.add_request("b", [42, 7, 7], greedy, client="b")
    out: dict[str, list[int]] = {}
    caps = set()
    while engine.has_unfinished:
        for o in engine.step():
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
        caps.add(engine.scheduler.decode_cap)
    assert engine.pool.num_free_blocks == engine.pool.num_blocks
    return out, caps


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_the_cap_leaves_greedy_tokens_unchanged(model_dir: Path, async_scheduling: bool) -> None:
    plain, caps = tokens(model_dir, fair_decode_batch="off")
    assert caps == {None}
    capped, caps = tokens(model_dir, fair_decode_batch=3, async_scheduling=async_scheduling)
    assert 3 in caps  # the cap engaged
    assert capped == plain
    assert all(len(t) == 12 for t in plain.values())


def test_a_capped_verify_step_gives_drafts_to_the_picked_only() -> None:
    """Speculative decoding: the sequences in the step get their k draft slots, the ones
    left out none (nor blocks for them)."""
    s = Scheduler(BlockPool(1024), B, 64, 2048, num_speculative_tokens=3)
    s.fair_decode_batch = 4
    reqs = decoding(s, {"a": 9, "b": 1})
    plan, chosen = s.schedule()
    assert len(chosen) == 4 and reqs[-1] in chosen
    assert all(seq.num_drafts == 3 and len(seq.token_ids) == 4 for seq in plan.seqs)
    left = [r for r in reqs if r not in chosen]
    assert all(r.num_drafts == 0 and r.num_computed_tokens == 3 for r in left)
    assert all(len(r.block_ids) == 1 for r in left)  # 4 tokens: one block, nothing more
