"""common/model/layers/linear.py: a GEMM on oneDNN-reordered weights (CPU, float32) equals
F.linear's to float32 rounding, for any leading shape, with and without bias; other dtypes
and a build without oneDNN keep F.linear."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from pdserve.common.model.layers.linear import Linear, can_prepack


@pytest.mark.parametrize("rows", [1, 7, 64, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_prepacked_gemm_equals_f_linear(rows: int, bias: bool) -> None:
    gen = torch.Generator().manual_seed(rows)
    w = torch.randn(96, 40, generator=gen)
    b = torch.randn(96, generator=gen) if bias else None
    x = torch.randn(rows, 40, generator=gen)
    lin = Linear(w, b, prepack=True)
    assert (lin.packed is not None) == can_prepack(w)
    want = F.linear(x, w, b)
    torch.testing.assert_close(lin(x), want, rtol=1e-5, atol=1e-5)
    x3 = x.view(1, rows, 40)  # leading dims kept
    assert lin(x3).shape == (1, rows, 96)
    torch.testing.assert_close(lin(x3)[0], want, rtol=1e-5, atol=1e-5)


def test_prepack_only_for_float32_on_cpu() -> None:
    w = torch.randn(8, 4)
    assert not can_prepack(w.to(torch.bfloat16))
    plain = Linear(w.to(torch.bfloat16), None, prepack=True)
    assert plain.packed is None
    x = torch.randn(3, 4, dtype=torch.bfloat16)
    assert torch.equal(plain(x), F.linear(x, w.to(torch.bfloat16)))
    off = Linear(w, None, prepack=False)
    assert off.packed is None


def test_the_engine_gives_the_same_greedy_tokens_with_and_without_prepack(
    model_dir: Path,
) -> None:
    from pdserve.common.engine.config import EngineConfig
    from pdserve.common.engine.llm_engine import LLMEngine
    from pdserve.common.engine.sampling import SamplingParams

    prompts = [[(i * 37 + 11) % 40000 + 5 for i in range(n)] for n in (3, 70)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    out = {}
    for prepack in (False, True):
        engine = LLMEngine(EngineConfig(model=str(model_dir), cpu_weight_prepack=prepack))
        assert (engine.runner.model.head is not None) == (prepack and can_prepack(torch.ones(1)))
        out[prepack] = [c.token_ids for c in engine.generate(prompts, params)]
    assert out[True] == out[False]
