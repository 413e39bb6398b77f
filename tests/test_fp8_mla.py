"""fp8 KV on MLA models (``--kv-cache-dtype fp8``): the latent cache as vLLM's 656-byte
fp8_ds_mla records (kernels/fp8_ds_mla.py), the logits of every decode step against the
auto cache, and the layout's bytes.

The model: a random DeepseekV3ForCausalLM of transformers' own classes (2 dense layers,
hidden 64, 4 heads, q_lora 32, kv_lora_rank 128 (fp8_ds_mla tiles the latent by 128), rope
16, yarn rope, interleaved), 4 prompts of 24-70 tokens, prefill + 32 teacher-forced decode
steps each: 132 positions, CPU, torch reference kernels.

Tolerance (measured on CPU): fp8_ds_mla against the float32 latent cache of a float32
model: cosine similarity of the logits min 0.99978, mean 0.99989; top-1 agreement 96.2%
(largest reference margin at a disagreement 0.0031). bfloat16 model against the bfloat16
cache: min 0.99978, mean 0.99987; top-1 97.7% (largest margin 0.0039). Thresholds as for GQA fp8 (tests/test_fp8_kv.py): cosine >= 0.999 at every
position; top-1 >= 90% overall and 100% where the reference's best two logits differ by more
than 0.05 (a random model's logits are nearly flat, so top-1 flips only where the
reference barely decides: 24% and 31% of the positions have a clear margin here).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from pdserve.common.engine.kv_layout import KVLayout
from pdserve.common.engine.latent_format import LatentFormat, cache_head
from pdserve.common.errors import ModelLoadError
from pdserve.common.model.checkpoint.config import ModelConfig
from pdserve.common.model.fixtures.random import save_random_model
from tests.test_fp8_kv import CLEAR_MARGIN, COSINE_MIN, CUDA, TOP1_MIN, _runner, _step_logits
from tests.test_mla import YARN

pytest.importorskip("transformers")

DSV3_FP8 = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "q_lora_rank": 32,
    "kv_lora_rank": 128,
    "qk_rope_head_dim": 16,
    "qk_nope_head_dim": 16,
    "v_head_dim": 16,
    "rope_scaling": YARN,
}


def build_fp8_mla(path: Path, **overrides: object) -> Path:
    return save_random_model(
        path,
        "deepseek_v3",
        seed=3,
        max_position_embeddings=4096,
        num_hidden_layers=2,
        first_k_dense_replace=2,
        tokenizer_from=os.environ.get("PDSERVE_TEST_MODEL") or None,
        **{**DSV3_FP8, **overrides},
    )


@pytest.fixture(scope="module")
def mla_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_fp8_mla(tmp_path_factory.mktemp("fp8mla"))


def test_fp8_ds_mla_layout_is_656_bytes_a_token_and_layer() -> None:
    fmt = LatentFormat(kv_lora_rank=512, rope_dim=64, dtype="bfloat16", kind="fp8_ds_mla")
    assert fmt.token_bytes == 656 == fmt.elements and fmt.storage_dtype == "uint8"
    assert [(s.name, s.offset, s.num_values, s.dtype) for s in fmt.sections] == [
        ("latent", 0, 512, "float8_e4m3fn"),
        ("scales", 512, 4, "float32"),
        ("rope", 528, 64, "bfloat16"),
    ]
    cfg = ModelConfig.from_dict(
        {
            "model_type": "deepseek_v3", "vocab_size": 100, "hidden_size": 7168,
            "intermediate_size": 128, "num_hidden_layers": 3, "num_attention_heads": 128,
        }
    )  # fmt: skip
    head_dim, parts, dtype = cache_head(cfg, "bfloat16", "float8_e4m3fn")
    assert (head_dim, parts, dtype) == (656, 1, "uint8")
    layout = KVLayout(
        num_blocks=10, num_layers=3, num_kv_heads=1, block_size=64, head_dim=head_dim,
        dtype=dtype, num_kv_parts=parts, order="block",
    )  # fmt: skip
    assert layout.bytes_per_token == 3 * 656  # against 3 * 1152 in bfloat16
    with pytest.raises(ValueError, match="multiple of 128, the model's is 96"):
        LatentFormat(kv_lora_rank=96, rope_dim=64, dtype="bfloat16", kind="fp8_ds_mla")


def test_fp8_refused_by_name_when_kv_lora_rank_is_not_tiled(tmp_path: Path) -> None:
    path = build_fp8_mla(tmp_path / "rank96", kv_lora_rank=96)
    with pytest.raises(ModelLoadError, match=r"--kv-cache-dtype: .*multiple of 128.* is 96"):
        _runner(path, "float32", "float8_e4m3fn")


def test_fp8_mla_cache_holds_records(mla_dir: Path) -> None:
    runner = _runner(mla_dir, "float32", "float8_e4m3fn")
    assert runner.kv_cache.dtype == torch.uint8
    assert runner.layout.head_dim == 128 + 4 + 2 * 16  # fp8 latent, 1 scale, bf16 rope
    assert runner.layout.bytes_per_token == 2 * 164
    assert runner.kv_compat()["dtype"] == "uint8"


@pytest.mark.parametrize(
    "device,dtype", [("cpu", "float32"), ("cpu", "bfloat16"), CUDA], ids=["fp32", "bf16", "cuda"]
)
def test_fp8_mla_logits_track_the_auto_cache_every_decode_step(
    mla_dir: Path, device: str, dtype: str
) -> None:
    """On CUDA (bfloat16, the Triton write and decode kernels, decode steps replayed from
    CUDA graphs) the same thresholds must hold."""
    gen = torch.Generator().manual_seed(15)
    vocab = ModelConfig.from_dir(mla_dir).vocab_size
    prompts = [torch.randint(vocab, (n,), generator=gen).tolist() for n in (24, 40, 57, 70)]
    auto = _runner(mla_dir, dtype, None, device)
    fp8 = _runner(mla_dir, dtype, "float8_e4m3fn", device)
    if device == "cuda":
        assert fp8.graphs is not None  # the decode steps below replay captured graphs
    assert auto.layout.dtype == dtype and fp8.layout.dtype == "uint8"
    ref, tokens = _step_logits(auto, prompts, None, 32)
    got, _ = _step_logits(fp8, prompts, tokens, 32)  # the same tokens: positions line up
    ref, got = ref.flatten(0, 1).cpu(), got.flatten(0, 1).cpu()  # [positions, vocab]
    assert not torch.equal(ref, got)  # the cache really was fp8
    cosine = torch.nn.functional.cosine_similarity(ref, got, dim=-1)
    agree = ref.argmax(-1) == got.argmax(-1)
    top2 = ref.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > CLEAR_MARGIN
    margins = (top2[:, 0] - top2[:, 1])[~agree]
    print(f"{dtype}: cosine min {cosine.min():.5f} mean {cosine.mean():.5f}, "
          f"top-1 {agree.float().mean():.3f} over {len(agree)} positions, largest margin "
          f"of a disagreement {margins.max() if len(margins) else 0.0:.4f}, "
          f"logit std {ref.std(-1).mean():.3f}, clear {clear.float().mean():.3f}")  # fmt: skip
    assert cosine.min().item() >= COSINE_MIN
    assert agree.float().mean().item() >= TOP1_MIN
    assert agree[clear].all()


def test_decode_refuses_a_producer_of_another_latent_format() -> None:
    from pdserve.common.transfer.kv_transfer import kv_dtype_mismatch

    shape = dict(num_blocks=4, num_layers=2, num_kv_heads=1, block_size=16, num_kv_parts=1)
    fp8 = KVLayout(**shape, head_dim=656, dtype="uint8")  # type: ignore[arg-type]
    bf16 = KVLayout(**shape, head_dim=576, dtype="bfloat16")  # type: ignore[arg-type]
    assert kv_dtype_mismatch(fp8, fp8) is None
    message = kv_dtype_mismatch(fp8, bf16) or ""
    assert "this decode stores uint8 fp8_ds_mla records (--kv-cache-dtype fp8)" in message
    assert "the producer bfloat16 (--kv-cache-dtype auto)" in message


@pytest.mark.slow
def test_pdserve_generate_with_fp8_kv_on_an_mla_model(mla_dir: Path) -> None:
    """``pdserve generate --kv-cache-dtype fp8`` runs an MLA model on the fp8_ds_mla cache
    and prints what the engine on that cache generates."""
    import subprocess
    import sys

    from pdserve.common.engine.config import EngineConfig
    from pdserve.common.engine.llm_engine import LLMEngine
    from pdserve.common.engine.sampling_params import SamplingParams

    text = "The quick brown fox jumps over the lazy dog."
    engine = LLMEngine(EngineConfig(model=str(mla_dir), kv_cache_dtype="fp8"))
    assert engine.runner.layout.dtype == "uint8"
    [out] = engine.generate([engine.tokenizer.encode(text)], SamplingParams(max_tokens=12))
    run = subprocess.run(
        [sys.executable, "-m", "pdserve.cli.main", "generate", "--raw", "--prompt", text,
         "--max-tokens", "12", "--model", str(mla_dir), "--kv-cache-dtype", "fp8"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert run.stdout == engine.tokenizer.decode(out.token_ids) + "\n"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("kv_cache_dtype", [None, "float8_e4m3fn"], ids=["auto", "fp8"])
def test_cuda_batch_of_12_graph_replays_equal_eager_steps(
    mla_dir: Path, kv_cache_dtype: str | None
) -> None:
    """Twelve sequences a decode step: the MLA decode kernel's large-batch tile (64 heads a
    program, kernels/triton_mla.py DECODE_TILES) over the auto and the fp8_ds_mla cache,
    bfloat16. Decode steps replayed from CUDA graphs (padded to 16) give the logits of the
    same steps run eagerly, bit for bit."""
    from pdserve.common.engine.model_runner import ModelRunner
    from pdserve.kernels import triton_mla

    assert triton_mla.decode_regime(12) == triton_mla.decode_regime(16) == "large"
    gen = torch.Generator().manual_seed(16)
    vocab = ModelConfig.from_dir(mla_dir).vocab_size
    prompts = [torch.randint(vocab, (20 + 5 * i,), generator=gen).tolist() for i in range(12)]

    def runner(graphs: bool) -> ModelRunner:
        return ModelRunner(
            ModelConfig.from_dir(mla_dir), mla_dir, device="cuda", dtype="bfloat16",
            block_size=16, num_blocks=128, kv_cache_memory_gb=0.1, gpu_memory_utilization=0.5,
            kv_cache_dtype=kv_cache_dtype, cuda_graph_max_batch=16, cuda_graphs=graphs,
            max_model_len=512,
        )  # fmt: skip

    graphed = runner(True)
    assert graphed.graphs is not None
    eager, tokens = _step_logits(runner(False), prompts, None, 8)
    replayed, _ = _step_logits(graphed, prompts, tokens, 8)
    assert torch.equal(replayed[1:], eager[1:])  # every decode step (0: the prefill)
