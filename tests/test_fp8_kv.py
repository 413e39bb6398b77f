"""fp8 KV cache (``--kv-cache-dtype fp8``) through the engine: configuration, layout bytes,
the logits of every decode step against the auto-dtype cache, and ``pdserve generate``.

Tolerance (measured on CPU, torch reference kernels, a random 2-layer GQA Llama of hidden
128, 8 heads, 2 KV heads; 4 prompts of 24-70 tokens, prefill + 32 teacher-forced decode steps
each: 132 positions). fp8 cache against the float32 cache of a float32 model: cosine
similarity of the logits min 0.99951, mean 0.99977; top-1 agreement 93.9%. bfloat16 model,
fp8 against the bfloat16 cache: min 0.99958, mean 0.99978; top-1 95.5%. A random model's
logits are nearly flat (std 0.23, the best two often within 0.02), so top-1 flips where the
reference barely decides: the largest reference margin at a disagreement was 0.0156.
Thresholds: cosine >= 0.999 at every position; top-1 >= 90% over the decided positions (the
reference's best two further apart than one step of the model dtype at their size: in
bfloat16 closer ones are ties that rounding settles; an H100 run in bfloat16 had one
prompt disagree at margins <= 0.004, 76% top-1 overall) and 100% at the positions whose
reference margin exceeds 0.05 (38% and 46% of them).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pdserve.common.engine.config import EngineConfig
from pdserve.common.engine.kv_layout import KVLayout
from pdserve.common.engine.model_runner import ModelRunner
from pdserve.common.engine.step_plan import ScheduledSeq, StepPlan
from pdserve.common.errors import PdserveError
from pdserve.common.model.checkpoint.config import ModelConfig
from pdserve.common.model.fixtures.random import save_random_llama
from pdserve.common.runtime.service_config import load_config

COSINE_MIN = 0.999
TOP1_MIN = 0.90
CLEAR_MARGIN = 0.05  # where the reference's best two logits differ by more, top-1 must agree
BLOCK = 16


@pytest.fixture(scope="module")
def gqa_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("gqa")
    return save_random_llama(
        path,
        hidden_size=128,
        num_heads=8,
        num_kv_heads=2,
        intermediate_size=256,
        num_layers=2,
        tokenizer_from=os.environ.get("PDSERVE_TEST_MODEL") or None,  # the GPU machine's
    )


# -- configuration -------------------------------------------------------------------------


def test_kv_cache_dtype_values_and_clear_error() -> None:
    assert EngineConfig().kv_cache_dtype == "auto"
    assert EngineConfig().kv_cache_torch_dtype_name == "float32"  # CPU: the model's
    assert EngineConfig(device="cuda").kv_cache_torch_dtype_name == "bfloat16"
    assert EngineConfig(kv_cache_dtype="fp8").kv_cache_torch_dtype_name == "float8_e4m3fn"
    with pytest.raises(
        PdserveError, match=r"unknown kv_cache_dtype 'fp4'; choose one of auto, fp8"
    ):
        EngineConfig(kv_cache_dtype="fp4")


def test_kv_cache_dtype_from_toml_env_and_flags(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    toml = tmp_path / "pdserve.toml"
    toml.write_text('[engine]\nkv_cache_dtype = "fp8"\n')
    assert load_config(toml).engine.kv_cache_dtype == "fp8"
    assert load_config(toml).engine_for("decode").kv_cache_dtype == "fp8"
    monkeypatch.setenv("PDSERVE_ENGINE__KV_CACHE_DTYPE", "auto")
    assert load_config(toml).engine.kv_cache_dtype == "auto"  # env over file
    assert load_config(toml, engine={"kv_cache_dtype": "fp8"}).engine.kv_cache_dtype == "fp8"
    monkeypatch.setenv("PDSERVE_ENGINE__KV_CACHE_DTYPE", "e5m2")
    with pytest.raises(PdserveError, match="unknown kv_cache_dtype 'e5m2'"):
        load_config()


def test_fp8_layout_halves_bf16_bytes() -> None:
    shape = dict(num_blocks=10, num_layers=16, num_kv_heads=8, block_size=64, head_dim=64)
    bf16, fp8 = KVLayout(**shape, dtype="bfloat16"), KVLayout(**shape, dtype="float8_e4m3fn")
    assert fp8.is_fp8 and not bf16.is_fp8
    assert 2 * fp8.bytes_per_token == bf16.bytes_per_token == 2 * 16 * 8 * 64 * 2
    assert 2 * fp8.head_block_bytes == bf16.head_block_bytes
    assert fp8.head_run(3, 2, 4) == (3 * 10 * fp8.head_block_bytes + 2 * fp8.head_block_bytes,
                                     4 * fp8.head_block_bytes)  # fmt: skip


# -- logits of every decode step -----------------------------------------------------------


def _runner(
    real_model_dir: Path, dtype: str, kv_cache_dtype: str | None, device: str = "cpu"
) -> ModelRunner:
    return ModelRunner(
        ModelConfig.from_dir(real_model_dir),
        real_model_dir,
        device=device,
        dtype=dtype,
        block_size=BLOCK,
        num_blocks=40,
        kv_cache_memory_gb=0.1,
        gpu_memory_utilization=0.5,
        kv_cache_dtype=kv_cache_dtype,
        cuda_graph_max_batch=8,  # CUDA: decode steps replay graphs (the scales baked in)
        max_model_len=512,
    )


def _step_logits(
    runner: ModelRunner, prompts: list[list[int]], forced: list[list[int]] | None, steps: int
) -> tuple[torch.Tensor, list[list[int]]]:
    """Prefill every prompt in one step, then ``steps`` batched decode steps feeding
    ``forced`` tokens (else greedy ones): logits [steps + 1, S, vocab] and the tokens fed.
    Each step's logits are copied: a CUDA-graph replay returns its graph's own float32
    output buffer, which the next replay of that graph overwrites."""
    tables = [list(range(1 + 8 * s, 9 + 8 * s)) for s in range(len(prompts))]
    plan = [ScheduledSeq(f"r{s}", p, 0, tables[s], True) for s, p in enumerate(prompts)]
    logits = [runner.execute(StepPlan(plan)).float().clone()]
    fed: list[list[int]] = [[] for _ in prompts]
    for i in range(steps):
        seqs = []
        for s, prompt in enumerate(prompts):
            token = forced[s][i] if forced else int(logits[-1][s].argmax())
            fed[s].append(token)
            seqs.append(ScheduledSeq(f"r{s}", [token], len(prompt) + i, tables[s], True))
        logits.append(runner.execute(StepPlan(seqs)).float().clone())
    return torch.stack(logits), fed


def agreement(ref: torch.Tensor, got: torch.Tensor, label: str) -> tuple[torch.Tensor, ...]:
    """(cosine, top-1 agreement, clear margin) per position of an fp8 cache's logits ``got``
    against the auto cache's ``ref`` ([positions, vocab], the same tokens fed), printed."""
    assert not torch.equal(ref, got)  # the cache really was fp8
    cosine = torch.nn.functional.cosine_similarity(ref, got, dim=-1)
    agree = ref.argmax(-1) == got.argmax(-1)
    top2 = ref.topk(2, dim=-1).values
    margin = top2[:, 0] - top2[:, 1]
    clear = margin > CLEAR_MARGIN
    worst = margin[~agree].max().item() if (~agree).any() else 0.0
    print(f"{label}: cosine min {cosine.min():.5f} mean {cosine.mean():.5f}, "
          f"top-1 {agree.float().mean():.3f} over {len(agree)} positions, "
          f"{agree[clear].float().mean():.3f} over the {int(clear.sum())} clear ones, "
          f"largest margin of a disagreement {worst:.4f}")  # fmt: skip
    return cosine, agree, clear


CUDA = pytest.param(
    "cuda",
    "bfloat16",
    marks=[
        pytest.mark.gpu,
        pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    ],
)


@pytest.mark.parametrize(
    "device,dtype", [("cpu", "float32"), ("cpu", "bfloat16"), CUDA], ids=["fp32", "bf16", "cuda"]
)
def test_fp8_logits_track_the_auto_cache_every_decode_step(
    gqa_dir: Path, device: str, dtype: str
) -> None:
    """On CUDA: bfloat16, Triton kernels, decode steps from CUDA graphs."""
    gen = torch.Generator().manual_seed(15)
    vocab = ModelConfig.from_dir(gqa_dir).vocab_size
    prompts = [torch.randint(vocab, (n,), generator=gen).tolist() for n in (24, 40, 57, 70)]
    auto = _runner(gqa_dir, dtype, None, device)
    fp8 = _runner(gqa_dir, dtype, "float8_e4m3fn", device)
    if device == "cuda":
        assert fp8.graphs is not None  # the decode steps below replay captured graphs
    assert auto.layout.dtype == dtype and fp8.layout.dtype == "float8_e4m3fn"
    ref, tokens = _step_logits(auto, prompts, None, 32)
    got, _ = _step_logits(fp8, prompts, tokens, 32)  # the same tokens: positions line up
    ref, got = ref.flatten(0, 1).cpu(), got.flatten(0, 1).cpu()  # [positions, vocab]
    assert not torch.equal(ref, got)  # the cache really was fp8
    cosine = torch.nn.functional.cosine_similarity(ref, got, dim=-1)
    agree = ref.argmax(-1) == got.argmax(-1)
    top2 = ref.topk(2, dim=-1).values
    margin = top2[:, 0] - top2[:, 1]
    clear = margin > CLEAR_MARGIN
    # Best two within one step of the model dtype's spacing at their size are a tie: the
    # logits come back in that dtype, so which one wins is rounding, not the cache.
    decided = margin > torch.finfo(getattr(torch, dtype)).eps * top2[:, 0].abs()
    margins = margin[~agree]  # empty when every position agrees
    print(f"{dtype}: cosine min {cosine.min():.5f} mean {cosine.mean():.5f}, "
          f"top-1 {agree.float().mean():.3f} over {len(agree)} positions "
          f"({agree[decided].float().mean():.3f} over {int(decided.sum())} decided), largest "
          f"margin of a disagreement {margins.max() if len(margins) else 0.0:.4f}, "
          f"logit std {ref.std(-1).mean():.3f}, clear {clear.float().mean():.3f}; by prompt: "
          f"top-1 {agree.view(-1, len(prompts)).float().mean(0).tolist()}, "
          f"decided {decided.view(-1, len(prompts)).float().mean(0).tolist()}")  # fmt: skip
    assert cosine.min().item() >= COSINE_MIN
    assert decided.float().mean().item() >= 0.5  # ties cannot make most of the test vacuous
    assert agree[decided].float().mean().item() >= TOP1_MIN
    assert agree[clear].all()


def test_fp8_cache_stores_one_byte_per_value(gqa_dir: Path) -> None:
    runner = _runner(gqa_dir, "float32", "float8_e4m3fn")
    assert runner.kv_cache.dtype == torch.float8_e4m3fn
    assert runner.kv_cache.element_size() == 1
    assert runner.layout.bytes_per_token == 2 * 2 * 2 * 16  # layers x K,V x KV heads x d
    assert runner.kv_compat()["dtype"] == "float8_e4m3fn"


# -- pdserve generate ----------------------------------------------------------------------


@pytest.mark.slow
def test_generate_with_fp8_kv_cache(real_model_dir: Path) -> None:
    """The embedded model, greedy, on CPU with an fp8 cache: still the right answer."""
    done = subprocess.run(
        [sys.executable, "-m", "pdserve", "generate", "--prompt",
         "What is the capital of France?", "--model", str(real_model_dir), "--max-tokens", "24",
         "--kv-cache-dtype", "fp8"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "Paris" in done.stdout


def test_generate_refuses_an_unknown_kv_cache_dtype() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "pdserve", "generate", "--prompt", "hi", "--kv-cache-dtype", "int4"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode != 0
    assert "--kv-cache-dtype: invalid choice: 'int4' (choose from 'auto', 'fp8')" in done.stderr
