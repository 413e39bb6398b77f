"""DeepSeek-V4 attention's packed input projections (``V4Attention.pack``: wq_a, wkv, the
compressors' wkv/wgate and the indexer's weights_proj as one GEMM, as CUDA runs them):
the state dict unchanged, each projection the same to float32 rounding, the greedy tokens
still transformers' (CPU, float32; tests/test_dsv4.py's checkpoint and prompts)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pdserve.common.engine.config import EngineConfig
from pdserve.common.engine.llm_engine import LLMEngine
from pdserve.common.engine.sampling import SamplingParams
from pdserve.common.model.deepseek.dsv4_attention import V4Attention
from pdserve.common.model.deepseek.dsv4_config import CSA, HCA, SLIDING
from tests.test_dsv4 import prompts, reference, v4_model  # noqa: F401  (fixtures)
from tests.test_families import NUM_TOKENS

pytest.importorskip("transformers")


def test_packed_projections_keep_the_state_and_the_tokens(
    v4_model: Path,  # noqa: F811
    prompts: list[list[int]],  # noqa: F811
    reference: list[list[int]],  # noqa: F811
) -> None:
    eng = LLMEngine(EngineConfig(model=str(v4_model), kv_cache_memory_gb=0.05))
    model = eng.runner.model
    before = {k: v.clone() for k, v in model.state_dict().items()}
    attns = [m for m in model.modules() if isinstance(m, V4Attention)]
    assert {a.kind for a in attns} == {SLIDING, CSA, HCA}
    x = torch.randn(3, attns[0].wq_a.in_features, generator=torch.Generator().manual_seed(0))
    unpacked = [a._project_x(x) for a in attns]
    for a in attns:
        a.pack()
    after = model.state_dict()
    assert after.keys() == before.keys()
    assert all(torch.equal(after[k], v) for k, v in before.items())
    for a, want in zip(attns, unpacked, strict=True):
        assert a.x_packed is not None and a.wq_a.weight.data_ptr() == a.x_packed.data_ptr()
        got = a._project_x(x)
        assert [g.shape for g in got] == [w.shape for w in want]
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
    outs = eng.generate(prompts[:2], SamplingParams(max_tokens=NUM_TOKENS))
    assert [o.token_ids for o in outs] == reference[:2]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_packed_projections_give_transformers_tokens(
    v4_model: Path,  # noqa: F811
    prompts: list[list[int]],  # noqa: F811
    reference: list[list[int]],  # noqa: F811
) -> None:
    """On CUDA (the Triton kernels, one GEMM of x a layer): transformers' greedy tokens.
    Packed before any step (a CUDA graph must be captured over the packed weights: the
    loader's pack_weights)."""
    eng = LLMEngine(
        EngineConfig(
            model=str(v4_model), device="cuda", dtype="float32", num_kv_blocks=4096,
            cuda_graphs=False,
        )
    )  # fmt: skip
    attns = [m for m in eng.runner.model.modules() if isinstance(m, V4Attention)]
    for a in attns:
        a.pack()
    outs = eng.generate(prompts, SamplingParams(max_tokens=NUM_TOKENS))
    assert [o.token_ids for o in outs] == reference
