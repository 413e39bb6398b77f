"""benchmarks/gpu.sh's ``dsv4-spec`` suite at a tiny scale on CPU: the same ``bench engine``
commands on ``--shape dsv4-flash`` with V4-Flash's config at tests/test_random_shapes.py's
tiny sizes (RANDOM_V4's: hidden 64, 8 experts, window 16), 3 layers (window, CSA, HCA;
the first two hash-routed).

* ``--dspark 5 --dspark-bigram``: the shape's checkpoint given a random DSpark module in a
  copy of its own (the shape's directory untouched), its Markov head a bigram table of the
  target's greedy output (drafts accepted), decode with and without it at batch 1 and 2,
  greedy tokens with speculation equal to those without, the JSON's rows and provenance;
* ``--routed-experts 8 --compare-tokens``: experts drawn at random, not zeros, and the
  engine's greedy tokens equal to transformers' ``DeepseekV4ForCausalLM``'s.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors import safe_open

from pdserve.cli.main import main
from pdserve.common.model.fixtures import random_shapes as rs
from tests.test_random_shapes import TINY

pytest.importorskip("transformers")

SIZES = ["--layers", "3", "--prompt-len", "24", "--gen-len", "8", "--repeats", "1"]


@pytest.fixture
def tiny_v4(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, model_dir: Path) -> list[str]:
    """``bench engine --shape dsv4-flash`` at the tiny sizes, its cache in ``tmp_path``."""
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setitem(
        rs.CONFIG_SHAPES, "dsv4-flash", {**rs.DEEPSEEK_V4_FLASH, **TINY["dsv4-flash"]}
    )
    return ["bench", "engine", "--shape", "dsv4-flash", "--tokenizer", str(model_dir), *SIZES]


def test_dspark_rows_and_greedy_tokens_equal_without_it(tiny_v4: list[str], tmp_path: Path) -> None:
    out = tmp_path / "spec.json"
    args = ["--dspark", "5", "--dspark-bigram", "--batch-sizes", "1,2", "--json", str(out)]
    assert main([*tiny_v4, *args]) == 0
    payload = json.loads(out.read_text())
    config = payload["config"]
    assert payload["benchmark"] == "engine_spec"
    assert config["git_commit"] and "--dspark 5" in config["command"]
    assert config["speculative_config"]["method"] == "dspark"
    assert config["speculative_config"]["num_speculative_tokens"] == 5
    assert config["dspark_random"] is True and config["dspark_stages"] == 1
    assert config["dspark_bigram_tokens"] > 0
    rows = payload["rows"]
    assert [r["batch"] for r in rows] == [1, 2]
    for r in rows:
        assert r["greedy_equal"] == r["batch"]  # speculation changed no greedy token
        assert 0.0 < r["acceptance_rate"] <= 1.0  # the bigram's drafts: some accepted
        assert 1.0 <= r["drafted_per_verify"] <= 5.0  # drafts made, at most k a step
        assert r["deferred"] == 0  # the 24-token prompts filled the windows of 16
        assert r["base_forward_ms"] > 0 and r["spec_forward_ms"] > 0
        assert 0 < r["base_forward_ms"] <= r["base_step_ms"]
        assert 0 < r["spec_forward_ms"] <= r["spec_step_ms"]
    # the module sits in a copy: the shape's own checkpoint has none
    model = Path(config["model_dir"])
    target = model.parent / "deepseek_v4-dsv4-flash-3l-bfloat16-zero-experts"
    assert "dspark_block_size" not in json.loads((target / "config.json").read_text())
    assert not (target / "mtp.safetensors").exists()
    raw = json.loads((model / "config.json").read_text())
    assert raw["dspark_block_size"] == 5 and raw["dspark_target_layer_ids"] == [0, 1, 2]
    assert raw["dspark_markov_rank"] == 1024  # room for the bigram table
    with safe_open(str(model / "mtp.safetensors"), "pt") as f:
        keys = list(f.keys())
        assert keys and all(k.startswith("mtp.0.") for k in keys)  # one stage
        expert = next(k for k in keys if ".experts." in k and "shared" not in k)
        attn = next(k for k in keys if k.endswith("attn.wkv.weight"))
        assert not f.get_tensor(expert).any()  # routed experts holes, as the target's
        assert f.get_tensor(attn).any()


def test_engine_greedy_tokens_equal_transformers(tiny_v4: list[str], tmp_path: Path) -> None:
    out = tmp_path / "hf.json"
    args = ["--routed-experts", "8", "--compare-tokens", "--batch-sizes", "1,2"]
    assert main([*tiny_v4, *args, "--json", str(out)]) == 0
    config = json.loads(out.read_text())["config"]
    # transformers' own class, not remote code or a stand-in
    assert config["hf_class"].startswith("transformers.models.deepseek_v4.")
    assert config["hf_class"].endswith(".DeepseekV4ForCausalLM")
    assert config["greedy_vs_hf"] == {
        "1": {"sequences": 1, "equal": 1, "first_difference": [None]},
        "2": {"sequences": 2, "equal": 2, "first_difference": [None, None]},
    }
    model = Path(config["model_dir"])
    raw = json.loads((model / "config.json").read_text())
    assert raw["n_routed_experts"] == 8
    assert raw["layer_types"] == [
        "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
    ]  # fmt: skip
    assert raw["mlp_layer_types"] == ["hash_moe", "hash_moe", "moe"]
    index = json.loads((model / "model.safetensors.index.json").read_text())["weight_map"]
    name = next(k for k in index if k.startswith("model.layers.2.") and ".experts.0." in k)
    with safe_open(str(model / index[name]), "pt") as f:
        assert f.get_tensor(name).any()  # drawn, not zeros: the routing decides the output


def test_refusals(tiny_v4: list[str]) -> None:
    """Before any checkpoint is written."""
    with pytest.raises(SystemExit, match="--compare-tokens needs HF"):
        main([*tiny_v4, "--compare-tokens", "--no-hf"])
    with pytest.raises(SystemExit, match="--dspark or --speculative-config, not both"):
        main([*tiny_v4, "--dspark", "5", "--speculative-config", '{"method": "ngram"}'])
    with pytest.raises(SystemExit, match="--dspark-bigram needs --dspark"):
        main([*tiny_v4, "--dspark-bigram"])
    with pytest.raises(SystemExit, match="--routed-experts need --shape"):
        main(["bench", "engine", "--routed-experts", "8"])
    with pytest.raises(SystemExit, match="--dspark needs a DeepSeek-V4 checkpoint"):
        main(["bench", "engine", "--dspark", "5"])


def test_compare_greedy_names_the_first_difference() -> None:
    from pdserve.cli.bench.bench_engine import compare_greedy

    engine = {1: [[5, 6, 7]], 2: [[1, 2, 3], [4, 5, 6]], 16: [[0]]}
    hf = {"class": "x", 1: [[5, 6, 7]], 2: [[1, 9, 3], [4, 5]]}  # HF skipped batch 16
    assert compare_greedy(engine, hf) == {
        "1": {"sequences": 1, "equal": 1, "first_difference": [None]},
        "2": {"sequences": 2, "equal": 0, "first_difference": [1, 2]},
    }
