"""DeepSeek-V4's layer glue and MoE at decode in few launches (#47), the whole model on the
Triton path: the fused glue (kernels/triton_hyper.py ``step``: the previous block's
combine, the hyper mix and the block's RMSNorm in one launch, the head's in one more) and
the shared expert folded into the MoE decode kernels give the logprobs of the reference's
ops (the same other kernels), float32 and bfloat16. Through Triton's interpreter on CPU
(``TRITON_INTERPRET=1 pytest -m interp``), or on CUDA with decode steps replayed from CUDA
graphs (``-m gpu``)."""

from __future__ import annotations

import pytest
import torch

from tests.kernel_tools import TRITON_DEVICES, fix_interpreter_index


def _logprobs(model, prompt, dtype: str, device: str, max_tokens: int = 3):  # noqa: ANN001, ANN202
    from pdserve.common.engine.config import EngineConfig
    from pdserve.common.engine.llm_engine import LLMEngine
    from pdserve.common.engine.sampling import SamplingParams

    engine = LLMEngine(
        EngineConfig(
            model=str(model), dtype=dtype, device=device, num_kv_blocks=256, block_size=16
        )  # CUDA: decode steps from CUDA graphs (the default)
    )
    engine.add_request("r", prompt, SamplingParams(max_tokens=max_tokens, logprobs=5))
    tokens, logprobs, done = [], [], False
    while not done:
        for out in engine.step():
            tokens += out.new_token_ids
            logprobs += [lp.top_logprobs for lp in out.logprobs]
            done = out.finished
    return tokens, torch.tensor(logprobs)


# the interpreter float32 alone (CI's time: ~35 s a run); CUDA both
CASES = [
    pytest.param(d.values[0], "float32", marks=d.marks, id=f"{d.id}-fp32") for d in TRITON_DEVICES
]
CASES.append(pytest.param("cuda", "bfloat16", marks=TRITON_DEVICES[0].marks, id="cuda-bf16"))


@pytest.mark.parametrize(("device", "dtype"), CASES)
def test_fused_glue_and_shared_expert_give_the_references_logprobs(
    tmp_path, model_dir, monkeypatch: pytest.MonkeyPatch, device: str, dtype: str
) -> None:  # type: ignore[no-untyped-def]
    """A 12-token prompt (prefill: one program per token) and 3 decode steps (batch 1: the
    MoE decode kernels with the shared expert folded in): fused against the reference glue
    and the shared expert on its own (the routed experts: the loop on CPU, the grouped GEMM
    on CUDA); bfloat16 within a few of its roundings (the fused combine rounds where the
    reference rounds; the MoE sums in float32 once)."""
    pytest.importorskip("transformers")
    from pdserve.common.model.deepseek import dsv4
    from pdserve.common.model.fixtures.random import save_random_v4
    from pdserve.kernels import triton_moe_decode

    if device == "cpu":
        fix_interpreter_index(monkeypatch)
    model = save_random_v4(tmp_path / "v4", tokenizer_from=model_dir)
    monkeypatch.setenv("PDSERVE_KERNELS", "triton")
    monkeypatch.setenv(triton_moe_decode.PAIRS_ENV, str(triton_moe_decode.MAX_PAIRS))
    prompt = list(range(7, 19))
    glue, folded = [], []
    real_glue, real_moe = dsv4.V4Layer._glue, triton_moe_decode.moe_experts
    monkeypatch.setattr(dsv4.V4Layer, "_glue", lambda *a, **k: glue.append(1) or real_glue(*a, **k))
    monkeypatch.setattr(
        triton_moe_decode,
        "moe_experts",
        lambda *a, **k: folded.append(k.get("shared") is not None) or real_moe(*a, **k),
    )
    tokens, fused = _logprobs(model, prompt, dtype, device)
    assert glue and folded and all(folded)  # the fused glue and the folded shared expert ran
    # the reference: the glue's torch ops; the routed experts' other path, the shared
    # expert's own ops
    monkeypatch.setattr(dsv4, "fused_glue", lambda streams: False)
    monkeypatch.setenv(triton_moe_decode.PAIRS_ENV, "0")
    glue.clear()
    want_tokens, want = _logprobs(model, prompt, dtype, device)
    assert not glue
    assert tokens == want_tokens
    tol = 1e-4 if dtype == "float32" else 5e-2
    torch.testing.assert_close(fused, want, rtol=tol, atol=tol)
