"""``pdserve bench transfer`` end to end at its smallest: two peer processes, the real
KVProducer / KVConsumer, one 1k-token pull per pattern. No speed is checked (a shared CI
machine says nothing about it); the bytes, descriptors and releases are."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pdserve.cli.main import main
from pdserve.common.engine.kv_layout import KVLayout

pytest.importorskip("nixl")
pytestmark = pytest.mark.slow

ROW_KEYS = ("tokens", "bytes", "descriptors", "nixl_descriptors", "gbps", "ceiling_gbps",
            "copy_gbps", "ratio", "device", "shape", "repeats", "pattern", "runs")  # fmt: skip


def test_bench_transfer_1b_1k(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "transfer.json"
    rc = main(["bench", "transfer", "--tokens", "1024", "--shape", "1b", "--repeats", "1",
               "--fragment", "1", "--json", str(out)])  # fmt: skip
    assert rc == 0
    payload = json.loads(out.read_text())
    assert payload["benchmark"] == "transfer"
    # Llama-3.2-1B: 16 layers, 8 KV heads, head_dim 64, bf16; 1,024 tokens = 16 blocks of 64
    layout = KVLayout(
        num_blocks=16, num_layers=16, num_kv_heads=8, block_size=64, head_dim=64, dtype="bfloat16"
    )
    assert layout.total_bytes == 32 * 2**20
    rows = payload["rows"]
    assert [(r["order"], r["pattern"]) for r in rows] == [
        ("head", "contiguous"),
        ("head", "fragmented"),
        ("block", "contiguous"),
        ("block", "fragmented"),
    ]
    for row in rows:
        assert all(key in row for key in ROW_KEYS), row
        assert (row["device"], row["shape"], row["tokens"], row["repeats"]) == (
            "cpu",
            "1b",
            1024,
            1,
        )
        assert row["bytes"] == row["bytes_pulled"] == layout.total_bytes
        assert row["gbps"] > 0 and row["ceiling_gbps"] > 0 and row["copy_gbps"] > 0
        assert row["ratio"] == pytest.approx(row["gbps"] / row["ceiling_gbps"])
        # NIXL merges exactly what we count as one descriptor
        assert row["nixl_descriptors"] == row["descriptors"]
    for order, heads in (("head", 8), ("block", 1)):
        contiguous, fragmented = (r for r in rows if r["order"] == order)
        assert contiguous["runs"] == 1 and fragmented["runs"] == 16  # every other block
        # descriptors follow runs: times the 8 KV heads in head order, once in block order
        assert contiguous["descriptors"] == heads and fragmented["descriptors"] == 16 * heads
        shape = payload["config"]["per_shape"][f"1b/{order}"]
        assert (
            shape["releases"] == shape["pulls"] == 2 * 3
        )  # checked + warm-up + 1 repeat, two rows
    lines = capsys.readouterr().out.strip().splitlines()
    assert "pull GB/s" in lines[1]
    assert [line.split()[1:3] for line in lines[3:]] == [
        ["head", "contiguous"],
        ["head", "fragmented"],
        ["block", "contiguous"],
        ["block", "fragmented"],
    ]


def test_bench_transfer_fp8_pulls_half_the_bytes(tmp_path: Path) -> None:
    """--kv-cache-dtype fp8: the same 1,024 tokens in float8_e4m3fn caches, pulled (and their
    bytes checked against the producer's pattern, as fp8 stores it) with half of bf16's bytes."""
    out = tmp_path / "transfer.json"
    rc = main(["bench", "transfer", "--tokens", "1024", "--shape", "1b", "--repeats", "1",
               "--fragment", "1", "--order", "block", "--kv-cache-dtype", "fp8",
               "--json", str(out)])  # fmt: skip
    assert rc == 0
    payload = json.loads(out.read_text())
    assert payload["config"]["dtype"] == "float8_e4m3fn"
    shape = dict(num_blocks=16, num_layers=16, num_kv_heads=8, block_size=64, head_dim=64)
    bf16 = KVLayout(**shape, dtype="bfloat16").total_bytes
    fp8 = KVLayout(**shape, dtype="float8_e4m3fn").total_bytes
    assert fp8 * 2 == bf16 == 32 * 2**20
    rows = payload["rows"]
    assert [(r["order"], r["pattern"]) for r in rows] == [
        ("block", "contiguous"),
        ("block", "fragmented"),
    ]
    for row in rows:
        assert row["bytes"] == row["bytes_pulled"] == fp8


def test_bench_transfer_dsv3_fp8_pulls_656_bytes_a_token_and_layer(tmp_path: Path) -> None:
    """--shape dsv3 --kv-cache-dtype fp8: the MLA latent as fp8_ds_mla records (uint8),
    256 tokens x 61 layers x 656 bytes pulled and checked against the producer's pattern."""
    out = tmp_path / "transfer.json"
    rc = main(["bench", "transfer", "--tokens", "256", "--shape", "dsv3", "--repeats", "1",
               "--fragment", "1", "--order", "block", "--kv-cache-dtype", "fp8",
               "--json", str(out)])  # fmt: skip
    assert rc == 0
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 2
    for row in rows:
        assert row["bytes"] == row["bytes_pulled"] == 256 * 61 * 656
