"""`pdserve bench accuracy`'s report (pure): the counters read off a deployment's /metrics
and the table. The run itself needs lm-eval and three deployments (minutes): its
command and result are in benchmarks/README.md."""

from __future__ import annotations

import argparse

import pytest

from pdserve.cli.bench import bench_accuracy

METRICS = """# TYPE pdserve:kv_transfers_total counter
pdserve:kv_transfers_total{service="decode",instance="0",rank="0"} 5
pdserve:kv_transfer_bytes_total{service="decode",instance="0",rank="0"} 4096
pdserve:kv_replica_releases_total{service="prefill",instance="0",rank="0"} 5
pdserve:kv_replica_releases_total{service="prefill",instance="0",rank="1"} 5
pdserve:requests_total{service="router",finish_reason="failed"} 1
pdserve:requests_total{service="router",finish_reason="length"} 4
"""


def test_counters_sum_every_rank_and_the_report_shows_them() -> None:
    """A PCP 2 prefill releases each transfer's replica on both ranks: releases = 2 x
    transfers; only failed requests count as API errors."""
    counters = bench_accuracy.parse_metrics(METRICS)
    assert counters["kv_transfers"] == 5 and counters["kv_transfer_bytes"] == 4096
    assert counters["kv_replica_releases"] == 10
    assert counters["failed_requests"] == 1
    score = {"items": 5, "correct": 2, "metric": "acc", "score": 0.4}
    result = {
        "modes": {
            "disaggregated": {"counters": counters, "service_restarts": 0, "scores": {"t": score}},
            "hf": {"scores": {"t": score}},
        },
        "agreement": {"disaggregated vs hf": {"t": {"items": 5, "same": 5,
                                                    "max_loglikelihood_diff": 0.0}}},
    }  # fmt: skip
    lines = bench_accuracy.format_report(result).splitlines()
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    row = dict(zip(header, (c.strip() for c in lines[2].strip("|").split("|")), strict=True))
    assert row["KV transfers"] == "5" and row["replica releases"] == "10"
    assert row["API errors"] == "1" and row["restarts"] == "0"
    hf = dict(zip(header, (c.strip() for c in lines[3].strip("|").split("|")), strict=True))
    assert hf["replica releases"] == "-"


def test_flags() -> None:
    parser = argparse.ArgumentParser()
    bench_accuracy.add_parser(parser.add_subparsers())
    args = parser.parse_args(["accuracy", "--random", "deepseek_v4", "--pcp", "2"])
    assert args.random == "deepseek_v4" and args.pcp == 2 and args.hf_batch_size == 8
    with pytest.raises(SystemExit):
        parser.parse_args(["accuracy", "--pcp", "0"])
    with pytest.raises(SystemExit):
        parser.parse_args(["accuracy", "--random", "llama"])
