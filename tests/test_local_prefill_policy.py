"""Conditional disaggregation's choice (services/router/local_prefill.py), on numbers."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdserve.common.errors import PdserveError
from pdserve.common.runtime.service_config import load_config
from pdserve.services.router.local_prefill import (
    PREFILL_BEHIND,
    SHORT,
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
