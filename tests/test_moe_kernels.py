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
from tests.kernel_tools import TRITON_DEVICES


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
    got = moe_grouped.moe_experts(x, ids, w, *part)  # small T*k: the dispatch takes the decode
    want = moe_ref.moe_experts(x.float(), ids, w, part[0].float(), part[1].float(), first)
    torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2 * want.abs().max().item())


@pytest.mark.gpu
@needs_cuda
def test_grouped_kernel_replays_in_a_cuda_graph() -> None:
    e, h, i, k = SHAPE["num_experts"], SHAPE["hidden"], SHAPE["inter"], SHAPE["top_k"]
    gate_up, down = weights(e, h, i, torch.bfloat16, "cuda")
    ids, w = routing(16, k, e, "cuda")
    x = torch.randn(16, h, device="cuda").to(torch.bfloat16)
    run = moe_grouped.moe_experts  # 16 x 8 pairs: the dispatch would take the decode kernels
    eager = run(x, ids, w, gate_up, down)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        run(x, ids, w, gate_up, down)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run(x, ids, w, gate_up, down)
    new_ids, _ = routing(16, k, e, "cuda", seed=7)
    ids.copy_(new_ids)  # new routing, same shapes: the replay follows it
    graph.replay()
    torch.cuda.synchronize()
    again = run(x, ids, w, gate_up, down)  # index_add_ order: atomics
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
    from pdserve.common.model.fixtures.random import save_random_model
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


# -- DeepSeek-V4's experts: the clamped SwiGLU ------------------------------------------------


@pytest.mark.parametrize("tokens", [1, 6, 40])
def test_clamped_grouped_path_equals_the_expert_loop_on_cpu(tokens: int) -> None:
    """DeepSeek-V4's swiglu_limit (gate clamped above, up on both sides) through the grouped
    path and the loop; weights large enough that the clamp bites."""
    gate_up, down = weights(16, 32, 24, torch.float32, "cpu")
    gate_up = gate_up * 60  # gate/up values well past the limit of 1
    ids, w = routing(tokens, 3, 16, "cpu")
    x = torch.randn(tokens, 32)
    clamped = moe_ref.moe_experts(x, ids, w, gate_up, down, 0, 1.0)
    assert not torch.allclose(clamped, moe_ref.moe_experts(x, ids, w, gate_up, down))
    got = moe_grouped.moe_experts(x, ids, w, gate_up, down, 0, 1.0)
    torch.testing.assert_close(got, clamped, rtol=1e-5, atol=1e-6)


def _v4_moe(hash_layer: bool, tp_size: int = 1, tp_rank: int = 0):  # noqa: ANN202
    """A small V4MoE (16 experts of 24, 3 a token, hidden 32, swiglu_limit 1) with random
    weights, and its experts as the per-expert modules they are loaded as."""
    from types import SimpleNamespace

    from pdserve.common.model.deepseek.dsv4 import V4MoE

    v4 = SimpleNamespace(
        num_experts=16, top_k=3, routed_scaling_factor=1.5, moe_intermediate_size=24,
        swiglu_limit=1.0, mlp_kinds=("hash_moe" if hash_layer else "moe",),
    )  # fmt: skip
    cfg = SimpleNamespace(hidden_size=32, vocab_size=50)
    par = SimpleNamespace(tp_size=tp_size, tp_rank=tp_rank, all_reduce_tp=lambda t: t)
    torch.manual_seed(3)
    moe = V4MoE(cfg, v4, 0, par)  # type: ignore[arg-type]
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn(p.shape) * 0.5)
        if hash_layer:
            moe.gate.tid2eid.copy_(torch.randint(0, 16, moe.gate.tid2eid.shape))
        else:
            moe.gate.bias.copy_(torch.randn(16))
    return moe


def _v4_moe_loop(moe, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
    """V4MoE's forward as it was: a loop over the chosen experts' modules (with .tolist())."""
    weights, ids = moe.gate(x, input_ids)
    out = torch.zeros_like(x)
    for e in ids.unique().tolist():
        if str(e) not in moe.experts:
            continue
        token, slot = torch.where(ids == e)
        y = moe.experts[str(e)](x[token]) * weights[token, slot, None]
        out.index_add_(0, token, y.to(out.dtype))
    return out + moe.shared_experts(x)


@pytest.mark.parametrize("hash_layer", [False, True], ids=["topk", "hash"])
@pytest.mark.parametrize(("tp_size", "tp_rank"), [(1, 0), (4, 2)])
def test_v4_moe_one_op_over_stacked_experts_equals_its_expert_loop(
    hash_layer: bool, tp_size: int, tp_rank: int
) -> None:
    """V4MoE's routed experts as one op over this rank's experts stacked: the result of the
    loop over its per-expert modules; after the stacking the modules' weights are views
    into the stacks (held once), and a replaced weight (a load) is stacked again."""
    moe = _v4_moe(hash_layer, tp_size, tp_rank)
    x = torch.randn(9, 32)
    input_ids = torch.randint(0, 50, (9,))
    want = _v4_moe_loop(moe, x, input_ids)
    torch.testing.assert_close(moe(x, input_ids), want, rtol=1e-5, atol=1e-6)
    gate_up, down = moe.stacked_experts()
    first = moe.experts[str(moe.first)]
    assert gate_up.shape == (16 // tp_size, 48, 32) and down.shape == (16 // tp_size, 32, 24)
    assert first.w1.weight.data_ptr() == gate_up.data_ptr()
    assert first.w2.weight.data_ptr() == down.data_ptr()
    with torch.no_grad():  # a new weight, as a load assigns it: stacked again
        first.w3.weight = torch.nn.Parameter(torch.randn(24, 32))
        first.w1.weight = torch.nn.Parameter(torch.randn(24, 32))
    want = _v4_moe_loop(moe, x, input_ids)
    torch.testing.assert_close(moe(x, input_ids), want, rtol=1e-5, atol=1e-6)


def test_v4_moe_marks_the_experts_it_reads() -> None:
    """record_expert_usage finds V4MoE blocks (benchmarks' experts-read column)."""
    from torch import nn

    from pdserve.common.model.layers.moe import record_expert_usage

    moe = _v4_moe(hash_layer=True)
    blocks = record_expert_usage(nn.Sequential(moe))
    assert blocks == [moe]
    input_ids = torch.tensor([3, 7])
    moe(torch.randn(2, 32), input_ids)
    want = set(moe.gate.tid2eid[input_ids].flatten().tolist())
    assert set(torch.nonzero(moe.touched).flatten().tolist()) == want


@pytest.mark.parametrize("hash_layer", [False, True], ids=["topk", "hash"])
def test_v4_shared_expert_packed_equals_its_three_linears(hash_layer: bool) -> None:
    """V4CausalLM.pack_weights packs each shared expert's w1/w3 (one GEMM, then
    kernels.silu_and_mul with the limit): the block's output as before; a w1 replaced
    after packing (a load) is read unpacked again."""
    moe = _v4_moe(hash_layer)
    x = torch.randn(9, 32) * 4  # past the limit of 1
    input_ids = torch.randint(0, 50, (9,))
    want = moe(x, input_ids)
    moe.shared_experts.pack()
    assert moe.shared_experts.w1.weight.data_ptr() == moe.shared_experts.gate_up.data_ptr()
    torch.testing.assert_close(moe(x, input_ids), want, rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        moe.shared_experts.w1.weight = torch.nn.Parameter(torch.zeros(24, 32))
    unpacked = _v4_moe_loop(moe, x, input_ids)  # its shared expert's forward: unpacked
    torch.testing.assert_close(moe(x, input_ids), unpacked, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(unpacked, want)


def test_deepseek_shared_experts_packed_equal_their_three_linears() -> None:
    """SparseMoeBlock.pack packs its shared experts' gate/up (as MLP.pack): same output."""
    from types import SimpleNamespace

    from pdserve.common.model.checkpoint.moe_config import MoEConfig
    from pdserve.common.model.layers.moe import SparseMoeBlock

    moe = MoEConfig(
        num_experts=16, top_k=3, intermediate_size=24, norm_topk_prob=True, scoring="sigmoid",
        n_group=4, topk_group=2, routed_scaling_factor=2.5, num_shared_experts=2,
    )  # fmt: skip
    par = SimpleNamespace(tp_size=1, tp_rank=0, all_reduce_tp=lambda t: t)
    torch.manual_seed(4)
    block = SparseMoeBlock(32, moe, par)  # type: ignore[arg-type]
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape) * 0.3)
    x = torch.randn(7, 32)
    want = block(x)
    block.pack()
    assert block.shared_experts is not None and block.shared_experts.gate_up is not None
    torch.testing.assert_close(block(x), want, rtol=1e-5, atol=1e-5)


# Flash's expert layer: 256 experts of 2048, 6 a token, hidden 4096 (a quarter of them here)
V4_SHAPE = {"num_experts": 64, "hidden": 4096, "inter": 2048, "top_k": 6}


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("tokens", [1, 16, 64])
def test_clamped_grouped_kernel_on_cuda_eager_graph_and_reference(tokens: int) -> None:
    """bfloat16 with V4's swiglu_limit (10) on CUDA: the dispatch's grouped path, eager and
    replayed in a CUDA graph, against the float32 loop reference."""
    e, h, i, k = (V4_SHAPE[n] for n in ("num_experts", "hidden", "inter", "top_k"))
    gate_up, down = weights(e, h, i, torch.bfloat16, "cuda")
    gate_up = gate_up * 8  # some gate/up values past 10
    ids, w = routing(tokens, k, e, "cuda")
    x = torch.randn(tokens, h, device="cuda").to(torch.bfloat16)
    assert moe_grouped.available(x, gate_up)
    run = moe_grouped.moe_experts  # the grouped path itself, at every size
    eager = run(x, ids, w, gate_up, down, 0, 10.0)
    want = moe_ref.moe_experts(x.float(), ids, w, gate_up.float(), down.float(), 0, 10.0)
    torch.testing.assert_close(eager.float(), want, rtol=2e-2, atol=2e-2 * want.abs().max().item())
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        run(x, ids, w, gate_up, down, 0, 10.0)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run(x, ids, w, gate_up, down, 0, 10.0)
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out.float(), eager.float(), rtol=1e-2, atol=1e-2)


# -- decode sizes: two Triton launches, no sort (kernels/triton_moe_decode.py) ---------------

DECODE_CASES = {
    "b1": (1, 0, 16, None),
    "ep-4-of-16": (5, 4, 4, None),  # some tokens with no expert on this rank
    "ep-last-clamped": (16, 12, 4, 1.0),
    "clamped-dup": (3, 0, 16, 1.0),  # token 0 routed twice to one expert (a hash table's row)
    "b20": (20, 0, 16, None),  # BLOCK_T 32
}


@pytest.fixture(params=TRITON_DEVICES)
def decode_device(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", list(DECODE_CASES))
def test_decode_kernels_equal_the_expert_loop(
    decode_device: str, dtype: torch.dtype, case: str
) -> None:
    """16 experts of 40 (not a multiple of the 16-row tiles), 3 a token, hidden 64: the two
    kernels against the loop reference on the same (dtype-rounded) weights in float32;
    experts shared by tokens, EP ranks, V4's limit, a token routed twice to one expert."""
    from pdserve.kernels import triton_moe_decode

    tokens, first, local, limit = DECODE_CASES[case]
    gate_up, down = weights(16, 64, 40, torch.float32, "cpu", seed=len(case))
    if limit is not None:
        gate_up = gate_up * 60  # past the limit: the clamp bites
    ids, w = routing(tokens, 3, 16, "cpu", seed=tokens)
    if case == "clamped-dup":
        ids[0, 1] = ids[0, 0]
    x = torch.randn(tokens, 64, generator=torch.Generator().manual_seed(tokens)).to(dtype)
    gate_up, down = gate_up[first : first + local].to(dtype), down[first : first + local].to(dtype)
    want = moe_ref.moe_experts(x.float(), ids, w, gate_up.float(), down.float(), first, limit)
    assert want.abs().max() > 0
    dev = decode_device
    got = triton_moe_decode.moe_experts(
        x.to(dev), ids.to(dev), w.to(dev), gate_up.to(dev), down.to(dev), first, limit
    )
    assert got.dtype == dtype and got.shape == want.shape
    tol = 1e-5 if dtype == torch.float32 else 1e-2  # bf16: the output's rounding
    torch.testing.assert_close(
        got.cpu().float(), want, rtol=tol, atol=tol * want.abs().max().item()
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    ("case", "inter_s"), [("b1", 40), ("ep-4-of-16", 24), ("clamped-dup", 40), ("b20", 8)]
)
def test_decode_kernels_fold_in_the_shared_expert(
    decode_device: str, dtype: torch.dtype, case: str, inter_s: int
) -> None:
    """The shared expert as one more slot of weight 1 (#47): the two kernels give the
    routed sum plus the shared expert's clamped SwiGLU of every token, against the loop
    reference plus that expert run on its own; its width the routed experts' or a TP
    rank's slice (24 of 40, 8 with BLOCK_T 32); on an EP rank whose experts some tokens
    do not use, those tokens get the shared expert alone."""
    from pdserve.kernels import triton_moe_decode

    tokens, first, local, limit = DECODE_CASES[case]
    gate_up, down = weights(16, 64, 40, torch.float32, "cpu", seed=len(case))
    sh_gate_up, sh_down = (t[0] for t in weights(1, 64, inter_s, torch.float32, "cpu", seed=9))
    if limit is not None:
        gate_up, sh_gate_up = gate_up * 60, sh_gate_up * 60  # past the limit: the clamp bites
    ids, w = routing(tokens, 3, 16, "cpu", seed=tokens)
    if case == "clamped-dup":
        ids[0, 1] = ids[0, 0]
    x = torch.randn(tokens, 64, generator=torch.Generator().manual_seed(tokens)).to(dtype)
    gate_up, down = gate_up[first : first + local].to(dtype), down[first : first + local].to(dtype)
    sh_gate_up, sh_down = sh_gate_up.to(dtype), sh_down.to(dtype)
    routed = moe_ref.moe_experts(x.float(), ids, w, gate_up.float(), down.float(), first, limit)
    shared = moe_ref.moe_experts(
        x.float(), torch.zeros(tokens, 1, dtype=torch.long), torch.ones(tokens, 1),
        sh_gate_up.float()[None], sh_down.float()[None], 0, limit,
    )  # fmt: skip
    want = routed + shared
    assert shared.abs().min() > 0 and routed.abs().max() > 0
    dev = decode_device
    got = triton_moe_decode.moe_experts(
        x.to(dev), ids.to(dev), w.to(dev), gate_up.to(dev), down.to(dev), first, limit,
        shared=(sh_gate_up.to(dev), sh_down.to(dev)),
    )  # fmt: skip
    assert got.dtype == dtype and got.shape == want.shape
    tol = 1e-5 if dtype == torch.float32 else 1e-2  # bf16: the output's rounding
    torch.testing.assert_close(
        got.cpu().float(), want, rtol=tol, atol=tol * want.abs().max().item()
    )


def test_dispatch_takes_the_decode_kernels_up_to_max_pairs(
    decode_device: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """kernels.moe_experts on the Triton backend: off by default; with
    PDSERVE_MOE_DECODE_PAIRS on, T*k <= MAX_PAIRS the decode kernels, past it not; 0 turns
    them off."""
    from pdserve.kernels import triton_moe_decode

    monkeypatch.delenv(triton_moe_decode.PAIRS_ENV, raising=False)
    x1 = torch.randn(1, 32, device=decode_device)
    ids1, _ = routing(1, 8, 16, decode_device)
    gate_up1, _ = weights(16, 32, 16, torch.float32, decode_device)
    assert not triton_moe_decode.fits(x1, ids1, gate_up1)  # off until timed on a GPU
    monkeypatch.setenv(triton_moe_decode.PAIRS_ENV, "1000")  # capped at MAX_PAIRS
    monkeypatch.setenv("PDSERVE_KERNELS", "triton")
    taken = []
    real = triton_moe_decode.moe_experts
    monkeypatch.setattr(
        triton_moe_decode, "moe_experts", lambda *a, **kw: taken.append(1) or real(*a, **kw)
    )
    gate_up, down = weights(16, 32, 16, torch.float32, decode_device)
    per_token = 8
    most = triton_moe_decode.MAX_PAIRS // per_token
    for tokens, want in ((1, 1), (most, 1), (most + 1, 0)):
        ids, w = routing(tokens, per_token, 16, decode_device)
        x = torch.randn(tokens, 32, device=decode_device)
        taken.clear()
        if want:
            kernels.moe_experts(x, ids, w, gate_up, down)
        assert triton_moe_decode.fits(x, ids, gate_up) == bool(want)
        assert len(taken) == want
    monkeypatch.setenv(triton_moe_decode.PAIRS_ENV, "0")  # off: an A/B run's other half
    assert not triton_moe_decode.fits(x[:1], ids[:1], gate_up)


def test_decode_kernels_compile_for_hopper() -> None:
    """Without a GPU: both kernels compile for sm90 in bf16 (30B-A3B's k 8, V4's 6 with its
    limit) and float32, with the 16-byte alignment a launch on torch's tensors specializes
    to, and their weight loads pipelined (cp.async)."""
    triton = pytest.importorskip("triton")
    from tests.kernel_tools import INTERPRET

    if INTERPRET:
        pytest.skip("TRITON_INTERPRET=1: kernels are interpreter functions")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from pdserve.kernels import triton_moe_decode as d

    def build(kernel, ptrs, consts, aligned, warps, stages):  # noqa: ANN001, ANN202
        sig = {n: ptrs.get(n, "constexpr" if n in consts else "i32") for n in kernel.arg_names}
        attrs = {(kernel.arg_names.index(n),): [["tt.divisibility", 16]] for n in aligned}
        src = ASTSource(kernel, sig, consts, attrs)
        opts = {"num_warps": warps, "num_stages": stages}
        return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts)

    cases = (("bf16", 8, 16, False, 768, 2048), ("bf16", 6, 32, True, 2048, 4096),
             ("fp32", 8, 16, False, 768, 2048))  # fmt: skip
    for dt, k, block_t, clamp, inter, hidden in cases:
        shared = clamp  # V4's: its shared expert folded in
        cfg = d.config(block_t, inter, hidden)
        precision = "ieee" if dt == "fp32" else "tf32"
        ptrs = {"x_ptr": f"*{dt}", "ids_ptr": "*i64", "w_ptr": f"*{dt}", "h_ptr": "*fp32",
                "ws_ptr": f"*{dt}", "limit": "fp32"}  # fmt: skip
        consts = dict(K=k, KP=triton.next_power_of_2(k), BLOCK_T=block_t,
                      BLOCK_I=cfg["block_i"], BLOCK_H=cfg["block_h"], CLAMP=clamp,
                      SHARED=shared, PRECISION=precision, UPCAST=False)  # fmt: skip
        aligned = ("x_ptr", "ids_ptr", "w_ptr", "h_ptr", "INTER", "H", "stride_xt",
                   "stride_we", "stride_wr", "stride_h")  # fmt: skip
        gate_up = build(d._gate_up_kernel, ptrs, consts, aligned, cfg["warps_gate_up"],
                        cfg["stages_gate_up"])  # fmt: skip
        ptrs = {"h_ptr": "*fp32", "ids_ptr": "*i64", "weights_ptr": "*fp32", "d_ptr": f"*{dt}",
                "ds_ptr": f"*{dt}", "out_ptr": f"*{dt}"}  # fmt: skip
        consts = dict(K=k, BLOCK_O=cfg["block_o"], BLOCK_K=cfg["block_k"], SHARED=shared,
                      PRECISION=precision, UPCAST=False)  # fmt: skip
        aligned = ("h_ptr", "ids_ptr", "weights_ptr", "d_ptr", "out_ptr", "INTER", "H",
                   "stride_de", "stride_dr", "stride_h", "stride_ot")  # fmt: skip
        down = build(d._down_kernel, ptrs, consts, aligned, cfg["warps_down"], cfg["stages_down"])
        if dt == "bf16":
            assert "cp.async" in gate_up.asm["ptx"] and "cp.async" in down.asm["ptx"], (k, block_t)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("shape", ["30b-a3b", "v4-flash"])
@pytest.mark.parametrize("tokens", [1, 16])
@pytest.mark.parametrize("ranks", [1, 4])
def test_decode_kernels_on_cuda_reference_and_graph_replay(
    shape: str, tokens: int, ranks: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """bf16 at 30B-A3B's layer and V4-Flash's (a quarter of its experts, limit 10), batch 1
    and 16, the whole expert set or rank 1 of 4: the dispatch takes the decode kernels; against the
    float32 loop; a CUDA-graph replay gives eager's bits, also after new routing is copied
    in (no atomics: one summation order)."""
    from pdserve.kernels import triton_moe_decode

    monkeypatch.setenv(triton_moe_decode.PAIRS_ENV, str(triton_moe_decode.MAX_PAIRS))
    sizes, limit = (SHAPE, None) if shape == "30b-a3b" else (V4_SHAPE, 10.0)
    e, h, i, k = (sizes[n] for n in ("num_experts", "hidden", "inter", "top_k"))
    gate_up, down = weights(e, h, i, torch.bfloat16, "cuda")
    if limit is not None:
        gate_up = gate_up * 8  # some gate/up values past 10
    ids, w = routing(tokens, k, e, "cuda")
    x = torch.randn(tokens, h, device="cuda").to(torch.bfloat16)
    per = e // ranks
    first = per if ranks > 1 else 0
    part = (gate_up[first : first + per], down[first : first + per], first, limit)
    assert triton_moe_decode.fits(x, ids, part[0])
    eager = kernels.moe_experts(x, ids, w, *part)
    want = moe_ref.moe_experts(x.float(), ids, w, part[0].float(), part[1].float(), first, limit)
    torch.testing.assert_close(eager.float(), want, rtol=2e-2, atol=2e-2 * want.abs().max().item())
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        kernels.moe_experts(x, ids, w, *part)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = kernels.moe_experts(x, ids, w, *part)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)
    new_ids, _ = routing(tokens, k, e, "cuda", seed=7)
    ids.copy_(new_ids)  # new routing, same shapes: the replay follows it
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, kernels.moe_experts(x, ids, w, *part))
    want = moe_ref.moe_experts(x.float(), ids, w, part[0].float(), part[1].float(), first, limit)
    torch.testing.assert_close(out.float(), want, rtol=2e-2, atol=2e-2 * want.abs().max().item())


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("tokens", [1, 16])
@pytest.mark.parametrize("tp", [1, 4])
def test_decode_kernels_with_the_shared_expert_on_cuda(
    tokens: int, tp: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """V4-Flash's layer (a quarter of its experts, limit 10) with its shared expert folded
    in (whole, or a TP rank's quarter of it), bf16, batch 1 and 16: kernels.moe_experts
    takes the decode kernels; against the float32 loop plus the shared expert's; a CUDA
    graph replay gives eager's bits."""
    from pdserve.kernels import triton_moe_decode

    monkeypatch.setenv(triton_moe_decode.PAIRS_ENV, str(triton_moe_decode.MAX_PAIRS))
    e, h, i, k = (V4_SHAPE[n] for n in ("num_experts", "hidden", "inter", "top_k"))
    gate_up, down = weights(e, h, i, torch.bfloat16, "cuda")
    gate_up = gate_up * 8  # some gate/up values past 10
    sh_gate_up, sh_down = (t[0] for t in weights(1, h, i // tp, torch.bfloat16, "cuda", seed=5))
    shared = (sh_gate_up * 8, sh_down)
    ids, w = routing(tokens, k, e, "cuda")
    x = torch.randn(tokens, h, device="cuda").to(torch.bfloat16)
    assert triton_moe_decode.fits(x, ids, gate_up, shared)
    eager = kernels.moe_experts(x, ids, w, gate_up, down, 0, 10.0, shared=shared)
    ones = torch.ones(tokens, 1, device="cuda")
    want = moe_ref.moe_experts(x.float(), ids, w, gate_up.float(), down.float(), 0, 10.0)
    want += moe_ref.moe_experts(
        x.float(), torch.zeros_like(ones, dtype=torch.long), ones,
        shared[0].float()[None], shared[1].float()[None], 0, 10.0,
    )  # fmt: skip
    torch.testing.assert_close(eager.float(), want, rtol=2e-2, atol=2e-2 * want.abs().max().item())
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        kernels.moe_experts(x, ids, w, gate_up, down, 0, 10.0, shared=shared)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = kernels.moe_experts(x, ids, w, gate_up, down, 0, 10.0, shared=shared)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)


# -- routing in one Triton kernel (kernels/triton_route.py) -----------------------------------

ROUTERS = {
    # Qwen3-MoE: softmax, renormalised (and not)
    "softmax-norm": dict(num_experts=128, top_k=8, norm_topk_prob=True),
    "softmax": dict(num_experts=12, top_k=6, norm_topk_prob=False),
    # DeepSeek-V3's grouped sigmoid: 8 groups of 32, 4 kept; V2-Lite's sizes ungrouped
    "v3-grouped": dict(
        num_experts=256,
        top_k=8,
        norm_topk_prob=True,
        scoring="sigmoid",
        n_group=8,
        topk_group=4,
        routed_scaling_factor=2.5,
    ),  # fmt: skip
    "sigmoid": dict(num_experts=64, top_k=6, norm_topk_prob=False, scoring="sigmoid"),
}


@pytest.fixture(params=TRITON_DEVICES)
def route_device(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.mark.parametrize("name", list(ROUTERS))
def test_route_kernel_chooses_the_references_experts_and_weights(
    route_device: str, name: str
) -> None:
    """The kernel against common/model/layers/moe.py's torch route (transformers' arithmetic):
    per token the same experts, the same weights (its k in descending order)."""
    from pdserve.common.model.checkpoint.moe_config import MoEConfig
    from pdserve.common.model.layers.moe import route
    from pdserve.kernels import triton_route

    moe = MoEConfig(intermediate_size=8, **ROUTERS[name])  # type: ignore[arg-type]
    gen = torch.Generator().manual_seed(len(name))
    logits = torch.randn(64, moe.num_experts, generator=gen) * 2
    bias = torch.randn(moe.num_experts, generator=gen) if moe.scoring == "sigmoid" else None
    want_w, want_ids = route(logits, moe, bias)  # CPU: the torch reference
    got_w, got_ids = triton_route.route(
        logits.to(route_device), moe.top_k, moe.norm_topk_prob, moe.scoring,
        None if bias is None else bias.to(route_device), moe.n_group, moe.topk_group,
        moe.routed_scaling_factor if moe.scoring == "sigmoid" else 1.0,
    )  # fmt: skip
    for t in range(logits.shape[0]):
        want = dict(zip(want_ids[t].tolist(), want_w[t].tolist(), strict=True))
        got = dict(zip(got_ids[t].cpu().tolist(), got_w[t].cpu().tolist(), strict=True))
        assert got.keys() == want.keys(), (t, sorted(got), sorted(want))
        for e, w in want.items():
            assert got[e] == pytest.approx(w, rel=1e-5, abs=1e-7)


def test_route_kernel_compiles_for_hopper() -> None:
    """Without a GPU: the kernel at Qwen3-30B-A3B's router (128 experts, 8) and DeepSeek-V3's
    (256 in 8 groups, 4 kept, 8) compiles for sm90."""
    triton = pytest.importorskip("triton")
    from tests.kernel_tools import INTERPRET

    if INTERPRET:
        pytest.skip("TRITON_INTERPRET=1: kernels are interpreter functions")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from pdserve.kernels import triton_route

    kernel = triton_route._route_kernel
    for consts in (
        dict(TOPK=8, K=8, BLOCK_E=128, SCORING=0, HASH=False, HAS_BIAS=False, GROUPS=1,
             PER_GROUP=1, TOPK_GROUP=1, NORM=True),
        dict(TOPK=8, K=8, BLOCK_E=256, SCORING=1, HASH=False, HAS_BIAS=True, GROUPS=8,
             PER_GROUP=32, TOPK_GROUP=4, NORM=True),
        dict(TOPK=6, K=8, BLOCK_E=64, SCORING=1, HASH=False, HAS_BIAS=True, GROUPS=1,
             PER_GROUP=1, TOPK_GROUP=1, NORM=False),
        dict(TOPK=6, K=8, BLOCK_E=256, SCORING=2, HASH=True, HAS_BIAS=False, GROUPS=1,
             PER_GROUP=1, TOPK_GROUP=1, NORM=True),
        dict(TOPK=6, K=8, BLOCK_E=256, SCORING=2, HASH=False, HAS_BIAS=True, GROUPS=1,
             PER_GROUP=1, TOPK_GROUP=1, NORM=True),
        dict(TOPK=6, K=8, BLOCK_E=256, SCORING=2, HASH=True, TOKENS=True, HAS_BIAS=False,
             GROUPS=1, PER_GROUP=1, TOPK_GROUP=1, NORM=True),  # V4: tid2eid read in the kernel
    ):  # fmt: skip
        consts.setdefault("TOKENS", False)
        ptrs = {"logits_ptr": "*bf16", "bias_ptr": "*bf16", "hash_ptr": "*i64",
                "tokens_ptr": "*i64", "weights_ptr": "*fp32", "ids_ptr": "*i64",
                "scale": "fp32"}  # fmt: skip
        sig = {n: ptrs.get(n, "constexpr" if n in consts else "i64") for n in kernel.arg_names}
        triton.compile(ASTSource(kernel, sig, consts), target=GPUTarget("cuda", 90, 32))


@pytest.mark.gpu
@needs_cuda
def test_route_kernel_replays_in_a_cuda_graph() -> None:
    """DeepSeek-V3's grouped sigmoid router at batch 64 on CUDA: the kernel through
    route's dispatch, eager = CUDA-graph replay, the same experts as the CPU reference."""
    from pdserve.common.model.checkpoint.moe_config import MoEConfig
    from pdserve.common.model.layers.moe import route

    moe = MoEConfig(intermediate_size=8, **ROUTERS["v3-grouped"])  # type: ignore[arg-type]
    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(64, 256, generator=gen) * 2).cuda()
    bias = torch.randn(256, generator=gen).cuda()
    eager_w, eager_ids = route(logits, moe, bias)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_w, out_ids = route(logits, moe, bias)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out_ids, eager_ids) and torch.equal(out_w, eager_w)
    want_w, want_ids = route(logits.cpu(), moe, bias.cpu())
    assert [sorted(r) for r in eager_ids.cpu().tolist()] == [sorted(r) for r in want_ids.tolist()]


@pytest.mark.parametrize("hash_layer", [False, True, "table"], ids=["topk", "hash", "table"])
def test_route_kernel_is_v4s_gate(route_device: str, hash_layer: bool | str) -> None:
    """DeepSeek-V4's Gate (sqrt(softplus) scores, top-k on scores + bias or the hash
    table's experts, weights over their sum times routed_scaling_factor) through the kernel
    against its torch forward, float32, 256 experts, 6 a token; ``table``: the whole
    tid2eid table (int32, a vocabulary of 50) read at the token ids in the kernel."""
    from pdserve.kernels import triton_route

    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(40, 256, generator=gen) * 3
    logits[0, :8] = 30.0  # softplus's linear range
    bias = torch.randn(256, generator=gen) * 0.1
    table = torch.randint(0, 256, (40, 6), generator=gen)
    token_ids = None
    if hash_layer == "table":
        vocab_table = torch.randint(0, 256, (50, 6), generator=gen, dtype=torch.int32)
        token_ids = torch.randint(0, 50, (40,), generator=gen)
        table = vocab_table[token_ids].long()
    scores = torch.nn.functional.softplus(logits).sqrt()
    ids = table if hash_layer else torch.topk(scores + bias, 6, dim=-1).indices
    want = scores.gather(1, ids)
    want = want / (want.sum(-1, keepdim=True) + 1e-20) * 1.5
    got_w, got_ids = triton_route.route(
        logits.to(route_device), 6, True, "sqrtsoftplus",
        None if hash_layer else bias.to(route_device), scale=1.5,
        hash_ids=(vocab_table if token_ids is not None else table).to(route_device)
        if hash_layer else None,
        token_ids=None if token_ids is None else token_ids.to(route_device),
    )  # fmt: skip
    if not hash_layer:  # the kernel's k in descending order: the reference's sorted too
        order = got_ids.cpu().argsort(-1)
        got_ids, got_w = got_ids.cpu().gather(1, order), got_w.cpu().gather(1, order)
        ref = ids.argsort(-1)
        ids, want = ids.gather(1, ref), want.gather(1, ref)
    assert torch.equal(got_ids.cpu(), ids)
    torch.testing.assert_close(got_w.cpu(), want, rtol=1e-4, atol=1e-6)  # log(1 + e^x): not log1p
