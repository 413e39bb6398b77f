"""DeepSeek-V3.2 on CUDA (``pytest -m gpu tests/test_dsv32_gpu.py``, the GPU machine): the
engine over the lightning indexer's kernel (kernels/triton_indexer.py) and sparse MLA's
(kernels/triton_sparse_mla.py) against transformers and the CPU path.

The model is tests/test_dsa.py's random checkpoint (index_topk 24, far below the prompts of
40, 300 and 1,500 tokens; 16 indexer heads of 32), in float32 on both devices. Must hold:
greedy tokens on CUDA = HF's = the CPU engine's; chunked prefill in 98-token chunks (not a
multiple of the 16-token blocks); CUDA graphs (decode steps captured) = eager; the fp8 cache
(kernels read the 656-byte records and 132-byte keys themselves) within
tests/test_fp8_dsa.py's documented agreement against the auto cache, on CUDA; preemption;
a prefix hit (the indexer keys restored); prefill PCP 2 -> decode over NIXL VRAM = the
monolithic engine, auto and fp8 caches.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pdserve.common.model.checkpoint.config import ModelConfig
from tests.test_dsa import build_v32
from tests.test_families import engine_greedy, hf_greedy, sentence_prompts

transformers = pytest.importorskip("transformers")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

# a fixed pool (~0.25 GB here), not a share of the card: a share of 0.2 gave the first engine
# 16 GB, and while a failed test's frames held it the next engine found none left
CUDA = {"device": "cuda", "dtype": "float32", "num_kv_blocks": 4096}


@pytest.fixture(scope="module")
def v32_model(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> Path:
    return build_v32(tmp_path_factory.mktemp("dsv32gpu") / "v32", tokenizer_from=model_dir)


@pytest.fixture(scope="module")
def prompts(model_dir: Path) -> list[list[int]]:
    return sentence_prompts(model_dir, (40, 300, 1500), 200)


@pytest.fixture(scope="module")
def reference(v32_model: Path, prompts: list[list[int]]) -> list[list[int]]:
    return hf_greedy(v32_model, prompts)


def test_cuda_greedy_equals_transformers_and_the_cpu_path(
    v32_model: Path, prompts: list[list[int]], reference: list[list[int]]
) -> None:
    cuda = engine_greedy(v32_model, prompts, **CUDA, cuda_graphs=False)
    assert cuda == reference
    assert engine_greedy(v32_model, prompts) == reference  # the CPU path


def test_cuda_chunks_not_aligned_to_blocks(
    v32_model: Path, prompts: list[list[int]], reference: list[list[int]]
) -> None:
    got = engine_greedy(
        v32_model, prompts[:2] * 2, **CUDA, block_size=16, max_num_batched_tokens=98
    )
    assert got == reference[:2] * 2


def test_cuda_graphs_equal_eager(v32_model: Path, prompts: list[list[int]]) -> None:
    """Decode steps replayed from captured graphs (the indexer's top-k and sparse MLA with
    no host read) give the eager steps' tokens."""
    from pdserve.common.engine.config import EngineConfig
    from pdserve.common.engine.llm_engine import LLMEngine
    from pdserve.common.engine.sampling import SamplingParams
    from tests.test_families import NUM_TOKENS

    eager = engine_greedy(v32_model, prompts, **CUDA, cuda_graphs=False)
    engine = LLMEngine(
        EngineConfig(model=str(v32_model), kv_cache_memory_gb=0.05, **CUDA, cuda_graphs=True)
    )
    graphs = engine.runner.graphs  # type: ignore[attr-defined]
    assert graphs is not None  # captured: V3.2 is not refused
    replays: list[int] = []
    graphs.on_replay = lambda plan: replays.append(len(plan.seqs))
    outs = engine.generate(prompts, SamplingParams(max_tokens=NUM_TOKENS))
    assert replays  # the decode steps ran as graphs
    assert [o.token_ids for o in outs] == eager


def test_cuda_fp8_cache_within_the_documented_agreement(tmp_path: Path, model_dir: Path) -> None:
    """tests/test_fp8_dsa.py's teacher-forced logits check (fp8 against auto, 4 prompts, 32
    decode steps each, index_topk 24: the selection over fp8 keys decides) with both runners
    on CUDA, and its thresholds for that setting."""
    from tests.test_fp8_dsa import FP8_V32
    from tests.test_fp8_kv import _runner, _step_logits, agreement

    path = build_v32(tmp_path / "v32", tokenizer_from=model_dir, **FP8_V32)
    gen = torch.Generator().manual_seed(15)
    vocab = ModelConfig.from_dir(path).vocab_size
    prompts = [torch.randint(vocab, (n,), generator=gen).tolist() for n in (40, 55, 70, 90)]
    auto = _runner(path, "float32", None, device="cuda")
    ref, tokens = _step_logits(auto, prompts, None, 32)
    fp8 = _runner(path, "float32", "float8_e4m3fn", device="cuda")
    assert fp8.kv_cache.dtype == torch.uint8
    got, _ = _step_logits(fp8, prompts, tokens, 32)
    cosine, agree, clear = agreement(
        ref.flatten(0, 1).cpu(), got.flatten(0, 1).cpu(), "v32 fp8 cuda"
    )
    assert cosine.mean().item() >= 0.99
    assert agree.float().mean().item() >= 0.75
    assert agree[clear].float().mean().item() >= 0.90


def test_cuda_preemption_and_resume(
    v32_model: Path, prompts: list[list[int]], reference: list[list[int]]
) -> None:
    """The CPU test's pool of 28 blocks of 16 on CUDA: sequences are preempted and their
    rows recomputed on resume; HF's tokens, every block back."""
    from tests.test_families import preemption_gives_the_reference

    preemption_gives_the_reference(
        v32_model, prompts, reference, 28, device="cuda", dtype="float32"
    )


def test_cuda_prefix_hit(
    v32_model: Path, prompts: list[list[int]], reference: list[list[int]]
) -> None:
    """tests.test_dsa's prefix-cache hit, on CUDA."""
    from tests.test_dsa import prefix_hit_restores_the_indexer_keys

    prefix_hit_restores_the_indexer_keys(
        v32_model, prompts, reference, device="cuda", dtype="float32"
    )


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_cuda_pcp2_prefill_to_decode_over_vram(
    tmp_path: Path,
    model_dir: Path,
    v32_model: Path,
    prompts: list[list[int]],
    reference: list[list[int]],
    kv_cache_dtype: str,
) -> None:
    """Prefill PCP 2 -> decode over NIXL VRAM on one GPU = the monolithic engine (auto:
    = HF's tokens too; fp8: the fp8 tests' checkpoint, whose sizes the fp8 rows take)."""
    from tests.gpu_tools import pcp2_over_vram_equals_the_monolithic_engine
    from tests.test_fp8_dsa import FP8_V32

    model = v32_model
    if kv_cache_dtype == "fp8":
        model = build_v32(tmp_path / "v32fp8", tokenizer_from=model_dir, **FP8_V32)
    got = pcp2_over_vram_equals_the_monolithic_engine(
        tmp_path / "pd", model, prompts, kv_cache_dtype
    )
    if kv_cache_dtype == "auto":
        assert got == reference
