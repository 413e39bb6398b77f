"""Conditional disaggregation's choice (services/router/local_prefill.py), on numbers."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdserve.common.errors import PdserveError
from pdserve.common.runtime.service_config import load_config
from pdserve.services.router.local_prefill import (
    FASTER_HERE,
    LOCAL,
    MIN_SAMPLES,
    PREFILL_BEHIND,
    REMOTE,
    SHORT,
    PathModel,
    PathModels,
    PrefillBacklog,
    local_reason,
    uncached_tokens,
)

IDLE = PrefillBacklog(num_queued_tokens=0, num_uncached_tokens=300)


def test_uncached_tokens_leave_the_last_token_to_compute() -> None:
    assert uncached_tokens(300, 0, 64) == 300
    assert uncached_tokens(300, 2, 64) == 300 - 128
    assert uncached_tokens(128, 2, 64) == 1  # every block cached: the last token still runs
    assert uncached_tokens(1, 5, 64) == 1


def test_threshold_zero_sends_everything_to_prefill() -> None:
    assert local_reason(0, 1, 0, [IDLE]) is None
    busy = PrefillBacklog(num_queued_tokens=10**6, num_uncached_tokens=300)
    assert local_reason(0, 300, 0, [busy]) is None


def test_short_uncached_part_is_prefilled_locally() -> None:
    assert local_reason(256, 255, 0, [IDLE]) == SHORT
    idle = PrefillBacklog(num_queued_tokens=0, num_uncached_tokens=256)
    assert local_reason(256, 256, 0, [idle]) is None  # "under" the threshold: strictly
    # a long prompt whose decode instance holds all but 100 tokens of it is short there
    assert local_reason(256, uncached_tokens(1000, 14, 64), 0, [IDLE]) == SHORT


def test_every_prefill_behind_sends_it_to_decode() -> None:
    behind = PrefillBacklog(num_queued_tokens=2000, num_uncached_tokens=1000)
    level = PrefillBacklog(num_queued_tokens=0, num_uncached_tokens=1000)
    assert local_reason(256, 1000, 0, [behind]) == PREFILL_BEHIND
    assert local_reason(256, 1000, 0, [behind, level]) is None  # one that is not: it goes there
    # decode's own local prefills in flight count against it: 2000 + 1000 is not more
    assert local_reason(256, 1000, 2000, [behind]) is None
    assert local_reason(256, 1000, 1999, [behind]) == PREFILL_BEHIND
    # a prefill instance with the prompt cached is not behind for it
    cached = PrefillBacklog(num_queued_tokens=900, num_uncached_tokens=1)
    assert local_reason(256, 1000, 0, [cached]) is None


def test_no_live_prefill_is_left_to_the_router() -> None:
    """With none up the router fails the request peer_down as before: no silent fallback."""
    assert local_reason(256, 1000, 0, []) is None


def test_threshold_from_toml_env_and_flag(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    toml = tmp_path / "pd.toml"
    toml.write_text("local_prefill_threshold = 64\n")
    assert load_config(toml).local_prefill_threshold == 64
    monkeypatch.setenv("PDSERVE_LOCAL_PREFILL_THRESHOLD", "32")
    assert load_config(toml).local_prefill_threshold == 32
    assert load_config(toml, local_prefill_threshold=0).local_prefill_threshold == 0
    with pytest.raises(PdserveError, match="local_prefill_threshold must be 0"):
        load_config(None, local_prefill_threshold=-1)


def test_bench_reads_the_local_share_from_two_scrapes() -> None:
    from pdserve.cli.bench.ttft_parts import local_prefills, local_share
    from pdserve.common.runtime.metrics import Metrics, render

    metrics = Metrics("router", 0)
    metrics.declare("pdserve:local_prefills", reason="short")
    before = render(metrics.samples()).decode()
    metrics.inc("pdserve:local_prefills", 3, reason="short")
    metrics.inc("pdserve:local_prefills", reason="prefill_behind")
    after = render(metrics.samples()).decode()
    assert "pdserve:local_prefills_total{" in after
    assert (local_prefills(before), local_prefills(after)) == (0, 4)
    assert local_share(before, after, 8) == 0.5
    # a server without the counter (colocated pdserve, a peer): no share, not 0
    assert local_share("", "pdserve:requests_total 1\n", 8) is None


# -- measured paths (PathModel): the choice informed by each path's recent TTFT ----------


def trained(overhead: float, per_token: float,
            works: tuple[int, ...] = (500, 1500, 3000, 6000)) -> PathModel:  # fmt: skip
    model = PathModel()
    for work in works:
        model.observe(work, overhead + per_token * work)
    return model


def test_a_path_model_fits_overhead_and_speed_from_recent_requests() -> None:
    model = trained(0.2, 1e-4)
    fit = model.fit()
    assert fit is not None
    assert fit[0] == pytest.approx(0.2) and fit[1] == pytest.approx(1e-4)
    assert model.predict(10_000) == pytest.approx(1.2)
    assert PathModel().predict(100) is None  # unmeasured
    few = PathModel()
    for work in range(MIN_SAMPLES - 1):
        few.observe(100 * (work + 1), 0.1)
    assert few.predict(100) is None  # too few samples to trust
    # one work size only: a line through 0
    flat = trained(0.0, 2e-4, works=(1000,) * MIN_SAMPLES)
    assert flat.predict(2000) == pytest.approx(0.4)
    # recent samples outweigh old ones: the path got 4x faster, the fit follows
    for _ in range(30):
        for work in (500, 3000):
            model.observe(work, 0.05 + 2.5e-5 * work)
    fit = model.fit()
    assert fit is not None and fit[1] == pytest.approx(2.5e-5, rel=0.05)


def test_measured_paths_decide_once_both_have_samples() -> None:
    """A mocked backlog: prefill idle, decode with no local prefill in flight, a prompt of
    2,000 uncached tokens. Token counts alone (the backlog rule) send it to the prefill
    instance; what the router measured decides instead."""
    idle = PrefillBacklog(num_queued_tokens=0, num_uncached_tokens=2000)
    # unmeasured (or one path only): the backlog rule, as before
    assert local_reason(256, 2000, 0, [idle], PathModels()) is None
    half = PathModels(local=trained(0.0, 1e-4))
    assert local_reason(256, 2000, 0, [idle], half) is None
    # time-sliced processes: a handover costs 0.3 s and prefill tokens run at half speed
    sliced = PathModels(local=trained(0.01, 1e-4), remote=trained(0.3, 2e-4))
    assert local_reason(256, 2000, 0, [idle], sliced) == FASTER_HERE
    # ... until decode's own local backlog makes it the slower one: 0.01 + 1e-4 * 7000
    # = 0.71 s against 0.3 + 2e-4 * 2000 = 0.7 s
    assert local_reason(256, 2000, 5000, [idle], sliced) is None
    assert local_reason(256, 2000, 4800, [idle], sliced) == FASTER_HERE
    # both roles concurrent on the GPU (MPS): the handover is cheap, decode's prefills
    # slow its decodes down: the prefill instance wins even where it is further behind,
    # which the backlog rule alone would have sent to decode
    behind = PrefillBacklog(num_queued_tokens=3000, num_uncached_tokens=2000)
    assert local_reason(256, 2000, 0, [behind]) == PREFILL_BEHIND
    split = PathModels(local=trained(0.01, 2e-4), remote=trained(0.02, 5e-5))
    assert local_reason(256, 2000, 0, [behind], split) is None
    # the threshold keeps its meaning: 0 never local, short prompts always local
    assert local_reason(0, 2000, 0, [idle], sliced) is None
    assert local_reason(256, 100, 0, [behind], split) == SHORT
    assert local_reason(256, 2000, 0, [], sliced) is None  # no prefill up: left to the router


def test_the_choice_follows_the_measurements_as_they_change() -> None:
    """The router's loop in numbers: each chosen path's TTFT observed; when the remote path
    slows down (its instance time-sliced), prompts move to decode within a few requests,
    and back when it recovers."""
    models = PathModels(local=trained(0.01, 1e-4), remote=trained(0.02, 5e-5))
    idle = PrefillBacklog(num_queued_tokens=0, num_uncached_tokens=2000)
    assert local_reason(256, 2000, 0, [idle], models) is None
    for _ in range(12):  # the remote path now takes 1 s whatever the work
        for work in (1000, 2000):
            models.observe(REMOTE, work, 1.0)
    assert local_reason(256, 2000, 0, [idle], models) == FASTER_HERE
    for _ in range(12):
        for work in (1000, 2000):
            models.observe(REMOTE, work, 0.02 + 5e-5 * work)
    assert local_reason(256, 2000, 0, [idle], models) is None
    models.observe(LOCAL, 100, 0.02)  # both paths learn from their own requests only
    assert models.local.num == MIN_SAMPLES + 1


def test_the_router_measures_each_path_from_its_choice_to_the_first_token() -> None:
    """Placement (services/router/placement.py) over two links with a mocked backlog and a
    stepped clock: each choice's path measured when its first token comes (not when a
    request ends without one), and once both paths are measured the choice follows them."""
    import asyncio
    import time

    from pdserve.common.runtime.service_config import load_config
    from pdserve.services.router.links import Link
    from pdserve.services.router.placement import Placement
    from pdserve.services.router.request_state import RequestState

    async def scenario() -> None:
        placement = Placement(load_config(local_prefill_threshold=256))
        now = time.monotonic()
        prefill, decode = (Link(role=role, index=0, address="", sock=None, ready=True,
                                last_pong=now, heard=now) for role in ("prefill", "decode"))  # fmt: skip
        placement.prefills, placement.decodes = [prefill], [decode]
        placement._last_tick = now
        clock = [0.0]
        placement.clock = lambda: clock[0]

        async def request(rid: str, tokens: int, seconds: float, answered: bool = True) -> str:
            state = RequestState(request_id=rid, trace_id=rid, num_prompt_tokens=tokens)
            local = await placement._local_prefill(state, [])
            clock[0] += seconds
            placement._local_prefilled(state, answered=answered)
            return "local" if local is decode else "remote"

        # short prompts: local (short), measured at 1 ms + 0.1 ms a token
        for k, n in enumerate((50, 100, 150, 200)):
            assert await request(f"s{k}", n, 0.001 + 1e-4 * n) == "local"
        # long ones: the backlog rule sends them to the idle prefill instance; a handover
        # costs 0.5 s there (time-sliced), its tokens 0.2 ms
        for k, n in enumerate((400, 800, 1200, 1600)):
            prefill.outstanding_tokens = 0
            assert await request(f"l{k}", n, 0.5 + 2e-4 * n) == "remote"
        models = placement.path_models
        assert (models.local.num, models.remote.num) == (4, 4)
        # both measured: a 1,000-token prompt is faster on decode (0.1 s against 0.7 s)
        assert await request("m0", 1000, 0.1) == "local"
        assert placement.metrics.value("pdserve:local_prefills", reason="faster_here") == 1
        # a request that ended without a first token measures nothing
        assert await request("x0", 1000, 30.0, answered=False) == "local"
        assert models.local.num == 5 and not placement._choices

    asyncio.run(scenario())


def test_a_path_seen_at_one_work_size_borrows_the_other_paths_speed() -> None:
    """Fixed-length prompts through an idle prefill instance: every remote sample has the
    same work, so its overhead and speed cannot be told apart; the local path's measured
    speed (a token costs the same on either instance) splits it, the rest overhead."""
    same = trained(0.3, 2e-4, works=(1000,) * MIN_SAMPLES)
    assert not same.spread and trained(0.3, 2e-4).spread
    assert same.predict(2000) == pytest.approx(1.0)  # alone: a line through 0 (0.5 s / 1000)
    models = PathModels(local=trained(0.01, 2e-4), remote=same)
    assert models.predict(REMOTE, 2000) == pytest.approx(0.3 + 2e-4 * 2000)
    assert models.predict(LOCAL, 2000) == pytest.approx(0.01 + 2e-4 * 2000)
    # neither spread: each its own line through 0
    flat = PathModels(local=trained(0.0, 1e-4, works=(100,) * 4), remote=same)
    assert flat.predict(REMOTE, 2000) == pytest.approx(1.0)
