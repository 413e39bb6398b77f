"""Mixture-of-experts models against Hugging Face transformers.

Qwen3-MoE: random ``Qwen3MoeForCausalLM`` checkpoints built by transformers' own classes and
saved with ``save_pretrained`` (per-expert keys), greedy through our engine at TP 1, 2 and
4 (expert parallelism: whole experts per rank), token for token with HF ``generate``.
DeepSeek-V3's block against transformers' own: tests/test_moe_deepseek.py. Routing under
expert parallelism: tokens whose experts all live on one rank, and tokens whose experts are
spread over every rank, equal TP 1 (Qwen3 and DeepSeek blocks).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from pdserve.common.engine.config import EngineConfig
from pdserve.common.engine.llm_engine import LLMEngine
from pdserve.common.engine.sampling import SamplingParams
from pdserve.common.errors import ModelLoadError
from pdserve.common.model.checkpoint.config import ModelConfig
from pdserve.common.model.checkpoint.moe_config import MoEConfig, check_ep
from pdserve.common.model.layers.moe import SparseMoeBlock, fuse_expert_weights, route
from pdserve.common.parallel.context import ParallelContext
from pdserve.kernels import moe_ref
from tests.test_families import engine_greedy, hf_greedy
from tests.test_moe_deepseek import deepseek_block

transformers = pytest.importorskip("transformers")

QWEN3_MOE: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "num_hidden_layers": 3,
    "moe_intermediate_size": 32,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "norm_topk_prob": True,
    "mlp_only_layers": [1],  # a dense layer between two sparse ones
}


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from pdserve.common.model.fixtures.random import save_random_model

    root = tmp_path_factory.mktemp("qwen3-moe")
    return save_random_model(
        root / "m", "qwen3_moe", max_position_embeddings=4096, seed=1, **QWEN3_MOE
    )


@pytest.fixture(scope="module")
def prompts(model_dir: Path) -> list[list[int]]:
    from pdserve.common.model.checkpoint.tokenizer import Tokenizer

    text = "The quick brown fox jumps over the lazy dog while the cat sleeps. " * 120
    ids = Tokenizer.from_dir(model_dir).encode(text)
    return [ids[:n] for n in (6, 100, 900)]


@pytest.fixture(scope="module")
def hf_tokens(qwen3_moe: Path, prompts: list[list[int]]) -> list[list[int]]:
    return hf_greedy(qwen3_moe, prompts)


@pytest.mark.parametrize(
    "extra",
    [{}, {"decoder_sparse_step": 2}, {"mlp_only_layers": [0, 2]}, {"num_experts": 0}],
)
def test_sparse_layers_as_transformers_builds_them(extra: dict[str, Any]) -> None:
    hf_cfg = transformers.AutoConfig.for_model("qwen3_moe", **{**QWEN3_MOE, **extra})
    model = transformers.AutoModelForCausalLM.from_config(hf_cfg)
    cfg = ModelConfig.from_dict(hf_cfg.to_dict())
    hf_sparse = [hasattr(layer.mlp, "experts") for layer in model.model.layers]
    assert [cfg.is_moe_layer(i) for i in range(len(hf_sparse))] == hf_sparse
    assert cfg.qk_norm and (cfg.moe is None or cfg.moe.num_experts == hf_cfg.num_experts)


def test_qwen3_moe_greedy_tokens_identical_to_transformers(
    qwen3_moe: Path, prompts: list[list[int]], hf_tokens: list[list[int]]
) -> None:
    assert ModelConfig.from_dir(qwen3_moe).moe is not None
    assert engine_greedy(qwen3_moe, prompts) == hf_tokens


def test_fused_expert_checkpoint_loads_as_the_per_expert_one(
    tmp_path: Path, qwen3_moe: Path, prompts: list[list[int]], hf_tokens: list[list[int]]
) -> None:
    """Experts stored as transformers' in-memory 3-D tensors (gate_up_proj, down_proj)."""
    import shutil

    from safetensors.torch import load_file, save_file

    cfg = ModelConfig.from_dir(qwen3_moe)
    assert cfg.moe is not None
    state = fuse_expert_weights(load_file(qwen3_moe / "model.safetensors"), cfg.moe)
    assert "model.layers.0.mlp.experts.gate_up_proj" in state
    assert not any(".experts.0." in k for k in state)
    fused = tmp_path / "fused"
    shutil.copytree(qwen3_moe, fused)
    save_file({k: v.contiguous() for k, v in state.items()}, str(fused / "model.safetensors"))
    assert engine_greedy(fused, prompts[:2]) == hf_tokens[:2]


def test_a_rank_reads_only_its_experts(tmp_path: Path, qwen3_moe: Path) -> None:
    """TP 4, rank 1 holds experts 2 and 3: from per-expert and from fused files alike it
    reads just those, and fuses them as a cut of the whole checkpoint would."""
    from safetensors.torch import load_file, save_file

    from pdserve.common.model.layers.moe import read_local_experts

    moe = ModelConfig.from_dir(qwen3_moe).moe
    assert moe is not None
    path = qwen3_moe / "model.safetensors"
    part = read_local_experts(path, moe, 4, 1)
    experts = {k.split(".experts.")[1].split(".")[0] for k in part if ".experts." in k}
    assert experts == {"2", "3"}
    want = fuse_expert_weights(load_file(path), moe, 4, 1)
    got = fuse_expert_weights(part, moe, 4, 1)
    assert want.keys() == got.keys()
    assert all(torch.equal(want[k], got[k]) for k in want)
    fused = tmp_path / "fused.safetensors"
    save_file(
        {k: v.contiguous() for k, v in fuse_expert_weights(load_file(path), moe).items()},
        str(fused),
    )
    sliced = read_local_experts(fused, moe, 4, 1)
    assert sliced["model.layers.0.mlp.experts.gate_up_proj"].shape[0] == 2
    got = fuse_expert_weights(sliced, moe, 4, 1)
    assert all(torch.equal(want[k], got[k]) for k in want)


def test_missing_expert_weights_are_named(qwen3_moe: Path) -> None:
    from safetensors.torch import load_file

    cfg = ModelConfig.from_dir(qwen3_moe)
    assert cfg.moe is not None
    state = load_file(qwen3_moe / "model.safetensors")
    del state["model.layers.2.mlp.experts.5.up_proj.weight"]
    with pytest.raises(ModelLoadError, match=r"layers\.2\.mlp\.experts\.5\.up_proj"):
        fuse_expert_weights(state, cfg.moe)


@pytest.mark.parametrize("tp", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_expert_parallel_tp_ranks_are_token_identical_to_transformers(
    qwen3_moe: Path, prompts: list[list[int]], hf_tokens: list[list[int]], tp: int
) -> None:
    """TP N: attention heads split, whole experts split (8 experts: 4 or 2 per rank)."""
    from pdserve.services.ranks.group import RankGroup

    cfg = EngineConfig(model=str(qwen3_moe), kv_cache_memory_gb=0.02)
    ranks = RankGroup.decode(cfg, tp, f"test-moe-tp{tp}")
    try:
        engine = LLMEngine(cfg, runner=ranks)
        outs = engine.generate(prompts, SamplingParams(max_tokens=len(hf_tokens[0])))
        assert [o.token_ids for o in outs] == hf_tokens
    finally:
        ranks.close()


def test_experts_that_do_not_split_over_tp_fail_at_start_naming_both(qwen3_moe: Path) -> None:
    moe = ModelConfig.from_dir(qwen3_moe).moe
    assert check_ep(2, moe) is None and check_ep(8, moe) is None
    assert check_ep(3, moe) == "8 experts do not split over TP 3 (expert parallelism)"
    from pdserve.common.engine.model_runner import ModelRunner

    cfg = ModelConfig.from_dir(qwen3_moe)
    heads_ok = msgspec_replace(
        cfg, num_attention_heads=6, num_key_value_heads=6, intermediate_size=96
    )
    with pytest.raises(ModelLoadError, match="8 experts do not split over TP 3"):
        ModelRunner(
            heads_ok,
            qwen3_moe,
            device="cpu",
            dtype="float32",
            block_size=16,
            num_blocks=4,
            kv_cache_memory_gb=0.01,
            gpu_memory_utilization=0.5,
            parallel=ParallelContext(tp_rank=0, tp_size=3),
        )


def msgspec_replace(cfg: ModelConfig, **changes: Any) -> ModelConfig:
    import msgspec

    return msgspec.structs.replace(cfg, **changes)


@pytest.mark.slow
def test_pdserve_generate_raw_on_qwen3_moe(qwen3_moe: Path, model_dir: Path) -> None:
    import subprocess
    import sys

    from pdserve.common.model.checkpoint.tokenizer import Tokenizer

    text = "The quick brown fox jumps over the lazy dog."
    tok = Tokenizer.from_dir(model_dir)
    [want] = hf_greedy(qwen3_moe, [tok.encode(text)])
    run = subprocess.run(
        [sys.executable, "-m", "pdserve.cli.main", "generate", "--raw", "--prompt", text]
        + ["--max-tokens", str(len(want)), "--model", str(qwen3_moe)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout == tok.decode(want) + "\n"


# -- expert parallelism: routing cases over real gloo ranks ---------------------------------


def qwen_case(hot: list[int], seed: int) -> tuple[MoEConfig, dict[str, Any], Any]:
    """A softmax block whose router sends every token to experts ``hot`` (a large logit
    from a constant feature), random otherwise."""
    moe = MoEConfig(
        num_experts=8, top_k=len(hot), intermediate_size=16, norm_topk_prob=True, sparse_layers=(0,)
    )
    gen = torch.Generator().manual_seed(seed)
    hidden = 32
    state = {
        "gate.weight": torch.randn(8, hidden, generator=gen) * 0.1,
        "experts.gate_up_proj": torch.randn(8, 32, hidden, generator=gen) * 0.2,
        "experts.down_proj": torch.randn(8, hidden, 16, generator=gen) * 0.2,
    }
    state["gate.weight"][hot, 0] = 5.0
    x = torch.randn(23, hidden, generator=gen)
    x[:, 0] = 3.0
    _, ids = route(torch.nn.functional.linear(x, state["gate.weight"]), moe)
    assert sorted(set(ids.flatten().tolist())) == sorted(hot)  # the routing the case means
    return moe, {k: v.numpy() for k, v in state.items()}, x.numpy()


def tp1(moe: MoEConfig, state: dict[str, Any], x: Any) -> torch.Tensor:
    block = SparseMoeBlock(x.shape[1], moe, ParallelContext())
    block.load_state_dict({k: torch.from_numpy(v) for k, v in state.items()})
    with torch.inference_mode():
        return block(torch.from_numpy(x))


@pytest.mark.parametrize("tp", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_routing_on_one_rank_and_spread_over_all_ranks_equals_tp1(tp: int) -> None:
    """8 experts over TP 2 (4 a rank) or TP 4 (rank r holds 2r, 2r + 1): every token to
    experts 6 and 7 (one rank holds both); every token to 0, 2, 4, 6 (spread over every
    rank); random routing; and the DeepSeek block (grouped sigmoid routing, its shared
    experts split over the ranks)."""
    from pdserve.common.runtime.ports import free_port_block
    from tests.moe_ep import run_ep

    one_rank = qwen_case([6, 7], seed=1)
    spread = qwen_case([0, 2, 4, 6], seed=2)
    moe = MoEConfig(num_experts=8, top_k=2, intermediate_size=16, norm_topk_prob=False)
    gen = torch.Generator().manual_seed(3)
    rand_state = {
        "gate.weight": torch.randn(8, 32, generator=gen),
        "experts.gate_up_proj": torch.randn(8, 32, 32, generator=gen) * 0.2,
        "experts.down_proj": torch.randn(8, 32, 16, generator=gen) * 0.2,
    }
    x = torch.randn(40, 32, generator=gen).numpy()
    rand = (moe, {k: v.numpy() for k, v in rand_state.items()}, x)
    hf, ds_moe = deepseek_block(True, seed=4)
    x = torch.randn(30, 64, generator=gen).numpy()
    ds = (ds_moe, {k: v.numpy() for k, v in hf.state_dict().items()}, x)
    cases = [one_rank, spread, rand, ds]
    got = run_ep(tp, cases, free_port_block(1))
    # one rank computed every expert of every token, the others added zeros: bit-equal
    assert np.array_equal(got[0], tp1(*one_rank).numpy())
    # the others sum the ranks' shares in another order: float32 rounding, no more
    for case, out in zip(cases[1:], got[1:], strict=True):
        torch.testing.assert_close(torch.from_numpy(out), tp1(*case), rtol=1e-4, atol=1e-5)


def test_expert_loop_reference_matches_transformers_experts() -> None:
    """kernels.moe_ref, also with an expert offset (a rank's share), against HF's loop."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    hf_cfg = transformers.AutoConfig.for_model("qwen3_moe", **QWEN3_MOE)
    hf = Qwen3MoeExperts(hf_cfg)
    torch.nn.init.normal_(hf.gate_up_proj, std=0.2)
    torch.nn.init.normal_(hf.down_proj, std=0.2)
    x = torch.randn(19, 64)
    ids = torch.randint(0, 8, (19, 2))
    w = torch.rand(19, 2)
    with torch.inference_mode():
        want = hf(x, ids, w)
        got = moe_ref.moe_experts(x, ids, w, hf.gate_up_proj, hf.down_proj)
        halves = [
            moe_ref.moe_experts(x, ids, w, hf.gate_up_proj[f : f + 4], hf.down_proj[f : f + 4], f)
            for f in (0, 4)
        ]
    assert torch.equal(got, want)
    torch.testing.assert_close(halves[0] + halves[1], want)


def test_benchmark_writer_moe_checkpoint_runs_as_transformers_does(
    tmp_path: Path, prompts: list[list[int]]
) -> None:
    """write_random_llama with experts (the 30b-a3b bench shape, tiny): HF's tokens."""
    from pdserve.common.model.fixtures.random_shapes import SHAPES, write_random_llama

    assert SHAPES["30b-a3b"]["num_experts"] == 128
    model = write_random_llama(
        tmp_path / "moe",
        num_layers=2,
        hidden_size=64,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        intermediate_size=128,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        dtype="float32",
    )
    assert ModelConfig.from_dir(model).moe is not None
    assert engine_greedy(model, prompts[:2]) == hf_greedy(model, prompts[:2])


# -- disaggregated: a real deployment -------------------------------------------------------


@pytest.mark.slow
def test_disaggregated_prefill_tp2_pcp2_to_decode_tp1_and_tp2(
    tmp_path: Path, qwen3_moe: Path, model_dir: Path
) -> None:
    """`pdserve up` with prefill TP 2 x PCP 2 (experts split over each TP pair) and two
    decode instances of TP 1 and TP 2: HF's tokens from both, every pool full after."""
    check_disaggregated_tp2_pcp2(tmp_path, qwen3_moe, model_dir)


def check_disaggregated_tp2_pcp2(tmp_path: Path, model: Path, model_dir: Path) -> None:
    import asyncio

    from pdserve.common.model.checkpoint.tokenizer import Tokenizer
    from pdserve.services.router.client import AsyncClient
    from tests.e2e import deployment
    from tests.test_serving import assert_pools_full, metrics

    tok = Tokenizer.from_dir(model_dir)
    texts = ["Monday, Tuesday,", "The quick brown fox jumps over the lazy dog. " * 12]
    want = hf_greedy(model, [tok.encode(t) for t in texts])
    with deployment(
        tmp_path,
        model,
        prefill_tp=2,
        pcp=2,
        decode_instances=2,
        decode_tp=[1, 2],
        pull_from="striped",
        engine={"kv_cache_memory_gb": 0.05},
    ) as d:

        async def run() -> list[list[int]]:
            async with AsyncClient(d.cfg.front_address) as client:
                jobs = [
                    client.generate(prompt=t, max_tokens=len(want[0]), temperature=0.0)
                    for t in texts * 2
                ]
                return [r.token_ids for r in await asyncio.gather(*jobs)]

        assert asyncio.run(run()) == want * 2
        snap = metrics(d.url)
        for instance in (0, 1):
            key = f"{{service=decode,instance={instance},rank=0}}"
            assert snap.get(f"pdserve:kv_transfers_total{key}", 0) > 0, instance
        assert_pools_full(d.url)
