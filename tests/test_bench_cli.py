"""``pdserve bench engine`` end to end on a tiny random model: the table and the JSON.

Timings on a shared CI machine mean nothing, so only their sign is checked.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from pdserve.cli.main import main

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from pdserve.common.model.fixtures.random import save_random_llama

    return save_random_llama(tmp_path_factory.mktemp("bench") / "tiny")


def test_bench_engine_writes_rows(
    tiny_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "results" / "engine.json"
    rc = main(
        [
            "bench",
            "engine",
            "--model",
            str(tiny_model),
            "--prompt-len",
            "16",
            "--gen-len",
            "4",
            "--batch-sizes",
            "1,2",
            "--json",
            str(out),
        ]
    )
    assert rc == 0
    payload = json.loads(out.read_text())
    config = payload["config"]
    assert (config["device"], config["dtype"]) == ("cpu", "float32")
    assert (config["prompt_len"], config["gen_len"]) == (16, 4)
    assert config["torch_version"] and config["cpu_count"] >= 1
    rows = payload["rows"]
    assert [r["batch"] for r in rows] == [1, 2]
    for row in rows:
        for key in (
            "engine_prefill_tok_s",
            "hf_prefill_tok_s",
            "engine_decode_tok_s",
            "hf_decode_tok_s",
            "prefill_ratio",
            "decode_ratio",
        ):
            assert row[key] > 0, (key, row)
        assert row["engine_prefill_steps"] == 1  # the batch's prompts were one step
        # against the machine's floors: a step can not beat the bytes it must read
        for key in ("engine_step_ms", "model_step_ms", "decode_floor_ms", "prefill_floor_s"):
            assert row[key] > 0, (key, row)
        assert row["model_step_ms"] <= row["engine_step_ms"]
        assert row["engine_step_over_floor"] == pytest.approx(
            row["engine_step_ms"] / row["decode_floor_ms"]
        )
    ceilings = config["ceilings"]
    assert ceilings["copy_gbps"] > 0 and ceilings["matmul_tflops"] > 0
    assert ceilings["kv_bytes_per_token"] > 0 and ceilings["weight_bytes"] > 0
    # stdout is the tables alone (logs and progress go to stderr): a header line, then
    # per table the column titles, a rule, one line per batch size; the ceilings between.
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 11
    assert "engine prefill tok/s" in lines[1] and "HF decode tok/s" in lines[1]
    assert [line.split()[0] for line in lines[3:5]] == ["1", "2"]
    assert lines[6].startswith("ceilings: copy") and "memory floor ms" in lines[7]
    assert [line.split()[0] for line in lines[9:]] == ["1", "2"]


def test_bench_engine_without_hf(
    tiny_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "engine.json"
    rc = main(
        [
            "bench",
            "engine",
            "--model",
            str(tiny_model),
            "--prompt-len",
            "8",
            "--gen-len",
            "2",
            "--batch-sizes",
            "3",
            "--repeats",
            "1",
            "--no-hf",
            "--json",
            str(out),
        ]
    )
    assert rc == 0
    [row] = json.loads(out.read_text())["rows"]
    assert row["engine_decode_tok_s"] > 0 and row["hf_decode_tok_s"] is None
    assert capsys.readouterr().out.strip().splitlines()[-1].split()[0] == "3"


def test_the_table_says_where_hf_was_skipped() -> None:
    """A batch size HF could not run (out of device memory) reads "skipped" in HF's
    columns, not "-" as if nobody had tried."""
    from pdserve.cli.bench.bench_rows import Row, format_table

    ran = Row(1, 10.0, 5.0, 0.1, 0.2, 1, hf_prefill_tok_s=5.0, prefill_ratio=2.0)
    skipped = Row(64, 10.0, 5.0, 0.1, 0.2, 1, hf_skipped="out of device memory")
    lines = format_table([ran, skipped]).splitlines()
    assert "skipped" not in lines[2] and "5.0" in lines[2]
    assert lines[3].split().count("skipped") == 4  # HF prefill, decode and both ratios


def test_bench_engine_rejects_a_one_token_generation() -> None:
    with pytest.raises(SystemExit):
        main(["bench", "engine", "--gen-len", "1"])


@pytest.mark.parametrize(
    "device",
    [
        "cpu",
        pytest.param(
            "cuda",
            marks=[
                pytest.mark.gpu,
                pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
            ],
        ),
    ],
)
def test_bench_engine_moe_floor_reads_only_the_touched_experts(
    tmp_path: Path, device: str, model_dir: Path
) -> None:
    """A Qwen3-MoE (8 experts, 2 a token, 2 layers): the decode floor counts the routed
    experts each step read (batch 1: exactly 2 per layer), not all 8. On CUDA (CUDA graphs,
    asynchronous scheduling) the count was never added: the column printed 0."""
    from pdserve.common.model.fixtures.random_shapes import write_random_llama

    model = write_random_llama(
        tmp_path / "moe",
        num_layers=2,
        hidden_size=64,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        intermediate_size=128,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        dtype="float32",
        tokenizer_from=model_dir,  # the GPU machine has no embedded model package
    )
    out = tmp_path / "engine.json"
    args = ["bench", "engine", "--model", str(model), "--prompt-len", "16", "--gen-len", "4"]
    args += ["--device", device, "--dtype", "float32"]  # CUDA's default is bfloat16
    assert main([*args, "--batch-sizes", "1,4", "--no-hf", "--json", str(out)]) == 0
    payload = json.loads(out.read_text())
    c = payload["config"]["ceilings"]
    assert c["expert_bytes"] == 3 * 64 * 32 * 4
    assert c["routed_expert_bytes"] == 2 * 8 * c["expert_bytes"]
    one, four = payload["rows"]
    assert one["experts_touched"] == 2 * 2
    assert 2 * 2 <= four["experts_touched"] <= 2 * 8
    for row in (one, four):
        read = (
            c["weight_bytes"]
            - c["routed_expert_bytes"]
            + row["experts_touched"] * c["expert_bytes"]
        )
        kv = row["batch"] * (16 + 4 / 2) * c["kv_bytes_per_token"]
        want_ms = (read + kv) / (c["copy_gbps"] * 1e9) * 1e3
        assert row["decode_floor_ms"] == pytest.approx(want_ms)
