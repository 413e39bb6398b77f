"""DeepSeek-V4 on CUDA (``pytest -m gpu tests/test_dsv4_gpu.py``, the GPU machine): the
engine over the V4 kernels (kernels/v4_ops.py -> kernels/triton_v4.py, the lightning
indexer's kernels/triton_indexer.py) against transformers and the CPU path.

The model is tests/test_dsv4.py's random checkpoint (sliding, CSA with its indexer keeping
6, HCA, CSA; hash_moe and moe; hc_mult 4; window 16; head_dim 32), in float32 on both
devices; prompts of 40, 300 and 1,500 tokens. Must hold: greedy tokens on CUDA = HF's =
the CPU engine's; chunked prefill with 98-token chunks (a multiple of neither 4 nor 16);
preemption; a prefix hit with bounded replay; CUDA graphs captured and replayed, tokens as
eager; the fp8 cache within tests/test_fp8_kv.py's documented agreement against the auto
cache, on CUDA; prefill PCP 2 -> decode over NIXL VRAM = the monolithic engine, auto and
fp8 caches.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pdserve.common.model.checkpoint.config import ModelConfig
from pdserve.common.model.fixtures.random import save_random_v4
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
def v4_model(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> Path:
    return save_random_v4(tmp_path_factory.mktemp("dsv4gpu") / "v4", tokenizer_from=model_dir)


@pytest.fixture(scope="module")
def prompts(model_dir: Path) -> list[list[int]]:
    return sentence_prompts(model_dir, (40, 300, 1500), 200)


@pytest.fixture(scope="module")
def reference(v4_model: Path, prompts: list[list[int]]) -> list[list[int]]:
    return hf_greedy(v4_model, prompts)


def test_cuda_greedy_equals_transformers_and_the_cpu_path(
    v4_model: Path, prompts: list[list[int]], reference: list[list[int]]
) -> None:
    cuda = engine_greedy(v4_model, prompts, **CUDA, cuda_graphs=False)
    assert cuda == reference
    assert engine_greedy(v4_model, prompts) == reference  # the CPU path


def test_cuda_chunks_not_aligned_to_entries_or_blocks(
    v4_model: Path, prompts: list[list[int]], reference: list[list[int]]
) -> None:
    got = engine_greedy(v4_model, prompts[:2] * 2, **CUDA, block_size=16, max_num_batched_tokens=98)
    assert got == reference[:2] * 2


def test_cuda_graphs_equal_eager(v4_model: Path, prompts: list[list[int]]) -> None:
    """Decode steps replayed from captured graphs (V4Step's static shapes, the indexer's
    top-k, the routing kernel and the grouped experts: no host read) give the eager steps'
    tokens, which are transformers'."""
    from pdserve.common.engine.config import EngineConfig
    from pdserve.common.engine.llm_engine import LLMEngine
    from pdserve.common.engine.sampling import SamplingParams
    from tests.test_families import NUM_TOKENS

    eager = engine_greedy(v4_model, prompts, **CUDA, cuda_graphs=False)
    engine = LLMEngine(
        EngineConfig(model=str(v4_model), kv_cache_memory_gb=0.05, **CUDA, cuda_graphs=True)
    )
    graphs = engine.runner.graphs  # type: ignore[attr-defined]
    assert graphs is not None  # captured: V4 is not refused
    replays: list[int] = []
    graphs.on_replay = lambda plan: replays.append(len(plan.seqs))
    outs = engine.generate(prompts, SamplingParams(max_tokens=NUM_TOKENS))
    assert replays  # the decode steps ran as graphs
    assert [o.token_ids for o in outs] == eager


def test_cuda_fp8_cache_within_the_documented_agreement(tmp_path: Path, model_dir: Path) -> None:
    """tests/test_fp8_dsv4.py's teacher-forced logits check (fp8 against auto, 4 prompts,
    32 decode steps each) with both runners on CUDA: the fp8 rows read by the kernels."""
    from tests.test_fp8_dsv4 import FP8_V4, _runner, _v4_step_logits
    from tests.test_fp8_kv import agreement

    path = save_random_v4(tmp_path / "v4", tokenizer_from=model_dir, **FP8_V4, index_topk=4096)
    gen = torch.Generator().manual_seed(15)
    vocab = ModelConfig.from_dir(path).vocab_size
    prompts = [torch.randint(vocab, (n,), generator=gen).tolist() for n in (40, 55, 70, 90)]
    ref, tokens = _v4_step_logits(_runner(path, None, "float32", "cuda"), prompts, None, 32)
    got, _ = _v4_step_logits(_runner(path, "float8_e4m3fn", "float32", "cuda"), prompts,
                             tokens, 32)  # fmt: skip
    cosine, agree, clear = agreement(ref.flatten(0, 1).cpu(), got.flatten(0, 1).cpu(), "cuda")
    assert cosine.mean().item() >= 0.995 and cosine.min().item() >= 0.95
    assert agree.float().mean().item() >= 0.85
    assert agree[clear].all()


def test_cuda_preemption_and_resume(
    v4_model: Path, prompts: list[list[int]], reference: list[list[int]]
) -> None:
    """The CPU test's pool of 40 blocks of 16 on CUDA: sequences are preempted and their
    rows recomputed on resume; HF's tokens, every block back."""
    from tests.test_families import preemption_gives_the_reference

    preemption_gives_the_reference(v4_model, prompts, reference, 40, device="cuda", dtype="float32")


def test_cuda_prefix_hit(
    v4_model: Path, prompts: list[list[int]], reference: list[list[int]]
) -> None:
    """tests.test_dsv4's prefix-cache hit, on CUDA."""
    from tests.test_dsv4 import prefix_hit_replays_a_window_and_a_stride

    prefix_hit_replays_a_window_and_a_stride(
        v4_model, prompts, reference, device="cuda", dtype="float32"
    )


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_cuda_pcp2_prefill_to_decode_over_vram(
    tmp_path: Path,
    model_dir: Path,
    v4_model: Path,
    prompts: list[list[int]],
    reference: list[list[int]],
    kv_cache_dtype: str,
) -> None:
    """Prefill PCP 2 -> decode over NIXL VRAM on one GPU = the monolithic engine (auto:
    = HF's tokens too; fp8: the fp8 tests' checkpoint, whose sizes the fp8 rows take)."""
    from tests.gpu_tools import pcp2_over_vram_equals_the_monolithic_engine
    from tests.test_fp8_dsv4 import FP8_V4

    model = v4_model
    if kv_cache_dtype == "fp8":
        model = save_random_v4(
            tmp_path / "v4fp8", tokenizer_from=model_dir, **FP8_V4, index_topk=4096
        )
    got = pcp2_over_vram_equals_the_monolithic_engine(
        tmp_path / "pd", model, prompts, kv_cache_dtype
    )
    if kv_cache_dtype == "auto":
        assert got == reference
