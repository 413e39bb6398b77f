"""The routed-expert kernels: the grouped-GEMM path (tokens sorted by expert, one
``torch._grouped_mm`` per projection) against the loop reference (which
tests/test_moe.py checks against transformers' experts bit for bit).

On CPU the grouped function runs through torch's own CPU grouped matmul (float32); with
``-m gpu`` on a CUDA machine at the Qwen3-30B-A3B layer shape in bfloat16, through the
``kernels.moe_experts`` dispatch, and captured in a CUDA graph.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pdserve import kernels
from pdserve.kernels import moe_grouped, moe_ref


def weights(
    num_experts: int, hidden: int, inter: int, dtype: torch.dtype, device: str, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator(device=device).manual_seed(seed)
    gate_up = torch.randn(num_experts, 2 * inter, hidden, generator=gen, device=device) * 0.05
    down = torch.randn(num_experts, hidden, inter, generator=gen, device=device) * 0.05
    return gate_up.to(dtype), down.to(dtype)


def routing(
    tokens: int, top_k: int, num_experts: int, device: str, seed: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator(device=device).manual_seed(seed)
    ids = torch.rand(tokens, num_experts, generator=gen, device=device).topk(top_k, dim=-1)[1]
    w = torch.rand(tokens, top_k, generator=gen, device=device)
    return ids, w / w.sum(-1, keepdim=True)


@pytest.mark.parametrize("tokens", [1, 5, 64])
@pytest.mark.parametrize(("first", "local"), [(0, 16), (4, 4), (12, 4)])
def test_grouped_path_equals_the_expert_loop_on_cpu(tokens: int, first: int, local: int) -> None:
    """16 experts, 3 a token; a rank holding all, or 4 of them (tokens whose experts all
    live elsewhere give zeros)."""
    gate_up, down = weights(16, 32, 24, torch.float32, "cpu")
    ids, w = routing(tokens, 3, 16, "cpu")
    x = torch.randn(tokens, 32)
    part = (gate_up[first : first + local], down[first : first + local], first)
    want = moe_ref.moe_experts(x, ids, w, *part)
    got = moe_grouped.moe_experts(x, ids, w, *part)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(("first", "local"), [(0, 16), (12, 4)])
def test_float32_rows_under_graph_capture_equal_the_expert_loop(
    first: int, local: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The float32 path taken while a CUDA graph is captured (each row times its expert's
    gathered weights, no host read of offs), run here on CPU: the loop's result."""
    monkeypatch.setattr(moe_grouped, "_capturing", lambda x: True)
    gate_up, down = weights(16, 32, 24, torch.float32, "cpu")
    ids, w = routing(7, 3, 16, "cpu")
    x = torch.randn(7, 32)
    part = (gate_up[first : first + local], down[first : first + local], first)
    want = moe_ref.moe_experts(x, ids, w, *part)
    got = moe_grouped.moe_experts(x, ids, w, *part)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_sort_by_expert_groups_rows_and_drops_other_ranks() -> None:
    ids = torch.tensor([[5, 1], [2, 5], [7, 4]])  # rank of experts 4..7
    order, valid, offs = moe_grouped.sort_by_expert(ids, 4, 4)
    local = (ids.flatten() - 4)[order]
    assert local[valid].tolist() == [0, 1, 1, 3]  # experts 4, 5, 5, 7, ascending
    assert valid.tolist() == [True] * 4 + [False] * 2
    assert offs.tolist() == [1, 3, 3, 4]


# -- CUDA ------------------------------------------------------------------------------------

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

# Qwen3-30B-A3B's layer: 128 experts of 768, 8 a token, hidden 2048
SHAPE = {"num_experts": 128, "hidden": 2048, "inter": 768, "top_k": 8}


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("tokens", [1, 7, 64, 512])
@pytest.mark.parametrize("ranks", [1, 4])
def test_grouped_kernel_on_cuda_matches_the_reference(tokens: int, ranks: int) -> None:
    """bfloat16 at the 30B-A3B shape, the whole expert set or rank 1 of 4 (EP)."""
    e, h, i, k = SHAPE["num_experts"], SHAPE["hidden"], SHAPE["inter"], SHAPE["top_k"]
    gate_up, down = weights(e, h, i, torch.bfloat16, "cuda")
    ids, w = routing(tokens, k, e, "cuda")
    x = torch.randn(tokens, h, device="cuda").to(torch.bfloat16)
    per = e // ranks
    first = per if ranks > 1 else 0
    part = (gate_up[first : first + per], down[first : first + per], first)
    assert moe_grouped.available(x, part[0])
    got = kernels.moe_experts(x, ids, w, *part)  # the dispatch picks the grouped path
    want = moe_ref.moe_experts(x.float(), ids, w, part[0].float(), part[1].float(), first)
    torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2 * want.abs().max().item())


@pytest.mark.gpu
@needs_cuda
def test_grouped_kernel_replays_in_a_cuda_graph() -> None:
    e, h, i, k = SHAPE["num_experts"], SHAPE["hidden"], SHAPE["inter"], SHAPE["top_k"]
    gate_up, down = weights(e, h, i, torch.bfloat16, "cuda")
    ids, w = routing(16, k, e, "cuda")
    x = torch.randn(16, h, device="cuda").to(torch.bfloat16)
    eager = kernels.moe_experts(x, ids, w, gate_up, down)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        kernels.moe_experts(x, ids, w, gate_up, down)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = kernels.moe_experts(x, ids, w, gate_up, down)
    new_ids, _ = routing(16, k, e, "cuda", seed=7)
    ids.copy_(new_ids)  # new routing, same shapes: the replay follows it
    graph.replay()
    torch.cuda.synchronize()
    again = kernels.moe_experts(x, ids, w, gate_up, down)  # index_add_ order: atomics
    torch.testing.assert_close(out.float(), again.float(), rtol=2e-2, atol=1e-2)
    assert not torch.equal(out, eager)


@pytest.mark.gpu
@needs_cuda
def test_qwen3_moe_on_cuda_graphs_eager_and_torch_give_hf_tokens(
    tmp_path: Path, model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A random Qwen3-MoE (16 experts, 4 a token) in float32 on CUDA: the grouped path with
    CUDA graphs, without, and the torch reference kernels all give HF's CPU tokens."""
    from pdserve.common.engine.config import EngineConfig
    from pdserve.common.engine.llm_engine import LLMEngine
    from pdserve.common.engine.sampling import SamplingParams
    from pdserve.common.model.random import save_random_model
    from tests.test_families import hf_greedy

    path = save_random_model(
        tmp_path / "qwen3-moe",
        "qwen3_moe",
        tokenizer_from=model_dir,
        hidden_size=256,
        intermediate_size=512,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=64,
        num_hidden_layers=3,
        moe_intermediate_size=128,
        num_experts=16,
        num_experts_per_tok=4,
        norm_topk_prob=True,
        mlp_only_layers=[1],
    )
    prompts = [
        [(i * 131 + j * 17) % 40000 + 5 for j in range(n)] for i, n in enumerate([3, 40, 300])
    ]
    want = hf_greedy(path, prompts)
    tokens = {}
    for name, graphs, backend in (
        ("graphs", True, "triton"),
        ("eager", False, "triton"),
        ("torch", False, "torch"),
    ):
        monkeypatch.setenv("PDSERVE_KERNELS", backend)
        engine = LLMEngine(
            EngineConfig(
                model=str(path),
                device="cuda",
                dtype="float32",
                num_kv_blocks=64,
                max_num_seqs=4,
                cuda_graphs=graphs,
            )
        )
        assert (engine.runner.graphs is not None) == graphs
        params = SamplingParams(max_tokens=len(want[0]))
        tokens[name] = [c.token_ids for c in engine.generate(prompts, params)]
        del engine
        torch.cuda.empty_cache()
    assert tokens["graphs"] == tokens["eager"] == tokens["torch"] == want
