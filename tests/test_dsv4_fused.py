"""DeepSeek-V4's layer glue and MoE at decode in few launches (#47), the whole model on the
Triton path through Triton's interpreter (``TRITON_INTERPRET=1 pytest -m interp``): the
fused glue (kernels/triton_hyper.py ``step``: the previous block's combine, the hyper mix
and the block's RMSNorm in one launch, the head's in one more) and the shared expert folded
into the MoE decode kernels give the logprobs of the reference's ops (the same other
kernels), float32 and bfloat16."""

from __future__ import annotations

import pytest
import torch

from tests.kernel_tools import INTERPRET

pytestmark = [
    pytest.mark.interp,
    pytest.mark.skipif(not INTERPRET, reason="set TRITON_INTERPRET=1 to interpret on CPU"),
]


def _logprobs(model, prompt, dtype: str, max_tokens: int = 3):  # noqa: ANN001, ANN202
    from pdserve.common.engine.config import EngineConfig
    from pdserve.common.engine.llm_engine import LLMEngine
    from pdserve.common.engine.sampling import SamplingParams

    engine = LLMEngine(
        EngineConfig(model=str(model), dtype=dtype, kv_cache_memory_gb=0.02, block_size=16)
    )
    engine.add_request("r", prompt, SamplingParams(max_tokens=max_tokens, logprobs=5))
    tokens, logprobs, done = [], [], False
    while not done:
        for out in engine.step():
            tokens += out.new_token_ids
            logprobs += [lp.top_logprobs for lp in out.logprobs]
            done = out.finished
    return tokens, torch.tensor(logprobs)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fused_glue_and_shared_expert_give_the_references_logprobs(
    tmp_path, model_dir, monkeypatch: pytest.MonkeyPatch, dtype: str
) -> None:  # type: ignore[no-untyped-def]
    """A 24-token prompt (prefill: one program per token) and 3 decode steps (batch 1: the
    MoE decode kernels with the shared expert folded in): fused against the reference glue
    and the shared expert on its own; bfloat16 within a few of its roundings (the fused
    combine rounds where the reference rounds; the MoE sums in float32 once)."""
    pytest.importorskip("transformers")
    from pdserve.common.model.deepseek import dsv4
    from pdserve.common.model.fixtures.random import save_random_v4
    from pdserve.kernels import triton_moe_decode
    from tests.test_mla_kernels import _fix_interpreter_index

    _fix_interpreter_index(monkeypatch)
    model = save_random_v4(tmp_path / "v4", tokenizer_from=model_dir)
    monkeypatch.setenv("PDSERVE_KERNELS", "triton")
    monkeypatch.setenv(triton_moe_decode.PAIRS_ENV, str(triton_moe_decode.MAX_PAIRS))
    prompt = list(range(7, 31))
    calls = []
    real_glue = dsv4.V4Layer._glue
    monkeypatch.setattr(
        dsv4.V4Layer, "_glue", lambda *a, **k: calls.append(1) or real_glue(*a, **k)
    )
    tokens, fused = _logprobs(model, prompt, dtype)
    assert calls  # the fused glue ran
    # the reference: the glue's torch ops; the routed experts' loop, the shared expert's ops
    monkeypatch.setattr(dsv4, "fused_glue", lambda streams: False)
    monkeypatch.setenv(triton_moe_decode.PAIRS_ENV, "0")
    want_tokens, want = _logprobs(model, prompt, dtype)
    assert tokens == want_tokens
    tol = 1e-4 if dtype == "float32" else 5e-2
    torch.testing.assert_close(fused, want, rtol=tol, atol=tol)
