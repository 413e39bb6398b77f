"""The benchmark shapes written from their config alone (common/model/fixtures/random_shapes.py
``CONFIG_SHAPES``: Qwen3-30B-A3B and DeepSeek-V2-Lite at full depth, DeepSeek-V3.2's and
V4-Flash's layers): at a tiny scale on CPU, config.json reads as transformers' config class
of the family, both transformers and the engine load every tensor (no key missing or left
over) and their greedy tokens agree; at full scale, each fits one 80 GB GPU in bf16 and
one more layer would not; the routed experts are holes of a sparse file; and the decode
floor counts what a V4 or V3.2 step reads of its cache."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from pdserve.common.model.fixtures import random_shapes as rs
from pdserve.common.model.fixtures.random import RANDOM_V4

_MLA = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=4,
            kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16,
            n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)  # fmt: skip
TINY = {
    "dsv4-flash": {
        k: v
        for k, v in RANDOM_V4.items()
        if k not in ("layer_types", "mlp_layer_types", "num_hidden_layers")
    },
    "dsv32": dict(
        _MLA,
        q_lora_rank=32,
        n_group=2,
        topk_group=1,
        index_n_heads=4,
        index_head_dim=32,
        index_topk=8,
    ),  # fmt: skip
    "v2-lite": dict(_MLA, num_hidden_layers=3),
    "30b-a3b-full": dict(
        hidden_size=64,
        intermediate_size=96,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        num_hidden_layers=3,
    ),  # fmt: skip
}
CONFIG_CLASS = {
    "dsv4-flash": "DeepseekV4Config",
    "dsv32": "DeepseekV32Config",
    "v2-lite": "DeepseekV3Config",
    "30b-a3b-full": "Qwen3MoeConfig",
}
GiB = 2**30


@pytest.mark.parametrize(
    "shape",
    [
        "dsv4-flash",
        "dsv32",
        pytest.param("v2-lite", marks=pytest.mark.slow),
        pytest.param("30b-a3b-full", marks=pytest.mark.slow),
    ],
)
def test_tiny_shape_loads_in_transformers_and_the_engine_alike(
    tmp_path: Path, model_dir: Path, shape: str
) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    from pdserve.common.engine.config import EngineConfig
    from pdserve.common.engine.llm_engine import LLMEngine
    from pdserve.common.engine.sampling import SamplingParams

    raw = {**rs.shape_config(shape), **TINY[shape]}
    out = rs.write_random_shape(
        tmp_path / shape, raw, dtype="float32", tokenizer_from=model_dir, zero_experts=False
    )
    assert type(AutoConfig.from_pretrained(out)).__name__ == CONFIG_CLASS[shape]
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) == raw["num_hidden_layers"] + 1
    hf, info = AutoModelForCausalLM.from_pretrained(
        out, dtype=torch.float32, output_loading_info=True
    )
    assert not any(info.values()), info  # no key missing, unexpected or mismatched
    prompt = [5, 6, 7, 8, 9, 10, 11]
    with torch.no_grad():
        want = hf.generate(torch.tensor([prompt]), max_new_tokens=4, do_sample=False)
    engine = LLMEngine(
        EngineConfig(model=str(out), device="cpu", dtype="float32", num_kv_blocks=32)
    )
    got = engine.generate([prompt], SamplingParams(max_tokens=4))[0].token_ids
    assert got == want[0, len(prompt) :].tolist()


def test_v4_flash_layers_keep_every_attention_kind_and_hash_routing() -> None:
    sw, csa, hca = (
        "sliding_attention",
        "compressed_sparse_attention",
        "heavily_compressed_attention",
    )
    four = rs.v4_flash_layers(4)
    assert four["layer_types"] == [sw, sw, csa, hca]
    assert four["mlp_layer_types"] == ["hash_moe"] * 3 + ["moe"]
    assert rs.v4_flash_layers(6)["layer_types"][4:] == [csa, hca]
    three = rs.v4_flash_layers(3)
    assert three["layer_types"] == [sw, csa, hca]
    assert three["mlp_layer_types"] == ["hash_moe", "hash_moe", "moe"]


# bytes one H100 holds (79.1 GiB) less what the engine needs beside the weights (CUDA
# context, KV cache, activations, CUDA graphs): the shapes leave at least this much
H100 = 79.1 * GiB
HEADROOM = 8 * GiB


@pytest.mark.parametrize("shape", list(rs.CONFIG_SHAPES))
def test_full_shape_fits_one_80gb_gpu_in_bf16_and_one_layer_more_would_not(
    shape: str, model_dir: Path
) -> None:
    """V4's first forward stacks one layer's experts beside the loaded ones (V4MoE): that
    peak counts. The full-depth shapes are whole models: no layer to add."""
    from pdserve.common.model.fixtures.random import tokenizer_vocab_size

    vocab = tokenizer_vocab_size(model_dir)

    def peak(layers: int | None) -> int:
        raw = {**rs.shape_config(shape, layers), "vocab_size": vocab}
        total, experts = rs.shape_bytes(raw)
        return total + (experts if raw["model_type"] == "deepseek_v4" else 0)

    layers = rs.CONFIG_SHAPES[shape]["num_hidden_layers"]
    assert peak(layers) <= H100 - HEADROOM, peak(layers) / GiB
    if shape in ("dsv32", "dsv4-flash"):
        assert peak(layers + 1) > H100 - HEADROOM, peak(layers + 1) / GiB


def test_routed_experts_are_holes_of_a_sparse_file(tmp_path: Path, model_dir: Path) -> None:
    """zero_experts: the experts read as zeros and take no disk blocks; the rest is random."""
    from safetensors import safe_open

    raw = {**rs.shape_config("30b-a3b-full"), **TINY["30b-a3b-full"], "num_experts": 64,
           "moe_intermediate_size": 256, "num_hidden_layers": 1}  # fmt: skip
    out = rs.write_random_shape(tmp_path / "z", raw, dtype="bfloat16", tokenizer_from=model_dir)
    layer = next(p for p in out.glob("model-00002-*.safetensors"))
    with safe_open(str(layer), "pt") as f:
        experts = f.get_tensor("model.layers.0.mlp.experts.gate_up_proj")
        router = f.get_tensor("model.layers.0.mlp.gate.weight")
    assert experts.shape == (64, 512, 64) and not experts.any()
    assert router.std() > 0.01
    stat = layer.stat()
    expert_bytes = 3 * 64 * 256 * 64 * 2
    assert stat.st_size > expert_bytes
    assert stat.st_blocks * 512 < stat.st_size - expert_bytes // 2  # mostly holes


def test_bench_refuses_a_shape_its_device_cannot_run_before_writing_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A shape whose family names an op the device lacks (here V4's attention, declared
    missing on CUDA as a family would for a device without the kernel): exit 2 naming it,
    nothing written (not 50 GB first)."""
    from pdserve.cli.main import main
    from pdserve.common.model.families import deepseek_v4

    def lacking(cfg: object, device_type: str) -> dict[str, str]:
        return {"sink_attention": "no kernel here"} if device_type == "cuda" else {}

    monkeypatch.setattr(deepseek_v4, "unsupported_ops", lacking, raising=False)
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path))
    assert main(["bench", "engine", "--shape", "dsv4-flash", "--device", "cuda"]) == 2
    assert "sink_attention: no kernel here" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


# -- the decode floor's cache reads -----------------------------------------------------------


def _cfg(shape: str):  # noqa: ANN202
    from pdserve.common.model.checkpoint.config import ModelConfig

    return ModelConfig.from_dict({**rs.shape_config(shape), "vocab_size": 1000})


def test_floor_reads_v4_window_rows_entries_and_selected_entries() -> None:
    """V4-Flash's 4 layers (window, window, CSA, HCA) in bf16: every layer's window of 128
    rows of 512 values; CSA every entry's indexer key (128 values an entry of 4 tokens) and
    its 512 selected entries; HCA every entry (one of 128 tokens)."""
    from pdserve.cli.bench.bench_floors import Ceilings, context_bytes, context_terms

    cfg = _cfg("dsv4-flash")
    assert cfg.v4 is not None
    width = cfg.v4.row_width(cfg.head_dim)
    terms = context_terms(cfg, 4 * width * 2)
    row, key = 512 * 2, 128 * 2
    assert terms == [(4 * row, 1, 128), (key, 4, 0), (row, 4, 512), (row, 128, 0)]
    c = Ceilings(0.0, 0.0, 0, 0, 0, 0, 0, context_terms=terms)
    ctx = 8192
    want = 4 * 128 * row + ctx / 4 * key + 512 * row + ctx / 128 * row
    assert context_bytes(c, ctx) == pytest.approx(want)
    assert context_bytes(c, 64) == pytest.approx(4 * 64 * row + 16 * key + 16 * row + row / 2)


def test_floor_reads_v32_indexer_keys_and_selected_latents() -> None:
    from pdserve.cli.bench.bench_floors import Ceilings, context_bytes, context_terms

    cfg = _cfg("dsv32")
    per_token = 4 * (512 + 64 + 128) * 2  # bf16 latent, rope, indexer key; 4 layers
    terms = context_terms(cfg, per_token)
    assert terms == [(4 * 128 * 2, 1, 0), (4 * 576 * 2, 1, 2048)]
    c = Ceilings(0.0, 0.0, 0, 0, 0, 0, 0, context_terms=terms)
    assert context_bytes(c, 10000) == pytest.approx(10000 * 4 * 256 + 2048 * 4 * 1152)
    dense = Ceilings(0.0, 0.0, 0, per_token, 0, 0, 0)  # no terms: every row
    assert context_bytes(dense, 100) == 100 * per_token


def test_bench_engine_on_a_tiny_v4_shape_counts_its_experts_and_cache_reads(
    tmp_path: Path, model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``random_shape_model`` of a V4 shape (here V4-Flash's config at RANDOM_V4's sizes, 3
    layers: window, CSA, HCA), written once, then ``bench engine`` on CPU: the experts-read
    column counts V4MoE's experts (batch 1: 2 a layer, 3 layers, 2 of them hash-routed), the
    floor counts V4's
    cache reads (context_terms) and the touched experts' bytes (8 experts of 3 x 32 x 64)."""
    from pdserve.cli.main import main

    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setitem(rs.CONFIG_SHAPES, "tiny-v4", {**rs.DEEPSEEK_V4_FLASH, **TINY["dsv4-flash"]})
    path = rs.random_shape_model("tiny-v4", num_layers=3, dtype="float32", tokenizer_from=model_dir)
    written = (path / "config.json").stat().st_mtime_ns
    again = rs.random_shape_model(
        "tiny-v4", num_layers=3, dtype="float32", tokenizer_from=model_dir
    )
    assert again == path and (path / "config.json").stat().st_mtime_ns == written
    raw = json.loads((path / "config.json").read_text())
    assert raw["layer_types"] == [
        "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
    ]  # fmt: skip
    out = tmp_path / "engine.json"
    args = ["bench", "engine", "--model", str(path), "--prompt-len", "40", "--gen-len", "4"]
    assert main([*args, "--batch-sizes", "1", "--no-hf", "--json", str(out)]) == 0
    payload = json.loads(out.read_text())
    c = payload["config"]["ceilings"]
    assert c["expert_bytes"] == 3 * 32 * 64 * 4
    assert c["routed_expert_bytes"] == 3 * 8 * c["expert_bytes"]
    assert len(c["context_terms"]) == 4  # window rows; CSA keys and entries; HCA entries
    (row,) = payload["rows"]
    # 2 a layer, less where a hash layer's random table gives a token one expert twice
    assert 2 + 2 * 1 <= row["experts_touched"] <= 2 * 3
    assert row["decode_floor_ms"] > 0
