"""The CUDA path end to end (GPU machine): KV in VRAM, NIXL moving VRAM between a prefill
and a decode process sharing one GPU, outputs token-identical to the monolithic engine."""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def test_vram_pulls_match_the_monolithic_engine(tmp_path: Path, gpu_llama: Path) -> None:
    """In float32: in bfloat16 a random model's near ties flip between a batch of six and one
    prompt at a time (the 1,000-token prompt's 7th token did on an H100 and an H200: its
    attention sum split otherwise, its best two logits nearly equal). The monolithic engine
    runs the prompts batched and one by one, so a difference names its side."""
    from pdserve.common.engine.config import EngineConfig
    from pdserve.common.engine.llm_engine import LLMEngine
    from pdserve.common.engine.sampling import SamplingParams
    from pdserve.services.router.client import Client
    from tests.e2e import deployment
    from tests.gpu_tools import gpu_memory_share

    prompts = [
        [(i * 31 + j * 7) % 40000 + 5 for j in range(n)]
        for i, n in enumerate([1, 63, 64, 65, 300, 1000])
    ]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    mono = LLMEngine(
        EngineConfig(model=str(gpu_llama), device="cuda", dtype="float32",
                     gpu_memory_utilization=gpu_memory_share())
    )  # fmt: skip
    batched = [c.token_ids for c in mono.generate(prompts, params)]
    alone = [mono.generate([p], params)[0].token_ids for p in prompts]
    del mono
    torch.cuda.empty_cache()
    assert batched == alone
    # each service process holds nothing else: a fixed share of the card fits any card
    engine = {"gpu_memory_utilization": 0.1, "dtype": "float32"}
    dep = deployment(tmp_path, gpu_llama, device="cuda", engine=engine)
    with dep, Client(dep.cfg.front_address) as client:
        got = [
            client.generate(
                prompt_token_ids=p, max_tokens=12, ignore_eos=True, temperature=0.0
            ).token_ids
            for p in prompts
        ]
    assert got == alone


def test_cuda_graph_decode_matches_eager(gpu_llama: Path) -> None:
    """A decode step replayed from a captured graph (5 sequences padded to 8) gives the
    logits of the same step run kernel by kernel, and writes the same KV."""
    from pdserve.common.engine.config import EngineConfig
    from pdserve.common.engine.model_runner import ModelRunner
    from pdserve.common.engine.step_plan import ScheduledSeq, StepPlan
    from pdserve.common.model.checkpoint.config import ModelConfig

    config = EngineConfig(
        model=str(gpu_llama),
        device="cuda",
        num_kv_blocks=64,
        block_size=16,
        max_num_seqs=8,
        cuda_graph_max_batch=8,
    )
    runner = ModelRunner.from_config(ModelConfig.from_dir(gpu_llama), gpu_llama, config)
    assert runner.graphs is not None and runner.graphs.sizes == [1, 2, 4, 8]
    lens = [1, 15, 16, 17, 40]
    tables = [list(range(8 * i, 8 * i + 8)) for i in range(len(lens))]
    prompts = [[(7 * i + 3 * j) % 1000 + 5 for j in range(n)] for i, n in enumerate(lens)]
    runner.execute(
        StepPlan(seqs=[ScheduledSeq(f"r{i}", p, 0, tables[i], True) for i, p in enumerate(prompts)])
    )
    step = StepPlan(
        seqs=[ScheduledSeq(f"r{i}", [11 + i], n, tables[i], True) for i, n in enumerate(lens)]
    )
    kv_before = runner.kv_cache.clone()
    graphed = runner.execute(step).clone()
    kv_graphed = runner.kv_cache.clone()
    # the step wrote its 5 slots and nothing else (the padding rows write nothing)
    changed = (kv_graphed != kv_before).flatten(1, 3).any(dim=(1, 3)).cpu()  # [blocks, offsets]
    expected = torch.zeros_like(changed)
    for table, n in zip(tables, lens, strict=True):
        expected[table[n // 16], n % 16] = True
    assert torch.equal(changed, expected)
    graphs, runner.graphs = runner.graphs, None
    eager = runner.execute(step)
    runner.graphs = graphs
    assert graphed.shape == eager.shape == (5, runner.cfg.vocab_size)
    assert torch.allclose(runner.kv_cache.float(), kv_graphed.float(), rtol=2e-2, atol=2e-2)
    err = ((graphed - eager).norm() / eager.norm()).item()
    assert err < 1e-2, err
    assert (graphed.argmax(-1) == eager.argmax(-1)).float().mean() >= 0.8
    # a prefill step (and any batch above the largest graph) still runs eagerly
    assert graphs.run(StepPlan(seqs=[ScheduledSeq("x", [1, 2], 0, tables[0], True)])) is None


def test_8b_shape_graphs_match_eager(model_dir: Path) -> None:
    """The Llama-3-8B layer shape (hidden 4096, 32 heads over 8 KV heads, head_dim 128) at 4
    layers, with a head-major KV cache past 2^31 elements (where #13 crashed): greedy tokens
    with CUDA graphs equal the eager engine's, for batches that straddle the captured sizes
    (17 sequences finishing at different lengths: 17 -> 1 running, padded to 24, 16, 8, ...)."""
    from pdserve.common.engine.config import EngineConfig
    from pdserve.common.engine.llm_engine import LLMEngine
    from pdserve.common.engine.sampling import SamplingParams
    from pdserve.common.model.fixtures.random_shapes import random_shape_model

    path = random_shape_model("8b", num_layers=4, device="cuda", tokenizer_from=model_dir)
    lens = [1, 5, 63, 64, 65, 100, 130, 200, 257, 300, 511, 512, 600, 700, 900, 1000, 1500]
    prompts = [[(i * 131 + j * 17) % 40000 + 5 for j in range(n)] for i, n in enumerate(lens)]
    params = [SamplingParams(max_tokens=4 + 3 * i, ignore_eos=True) for i in range(len(lens))]
    tokens = {}
    for graphs in (True, False):
        engine = LLMEngine(
            EngineConfig(
                model=str(path),
                device="cuda",
                dtype="bfloat16",
                kv_order="head",
                num_kv_blocks=4800,  # 8 heads x 4800 blocks x 65,536 elements > 2^31
                max_num_seqs=32,
                max_num_batched_tokens=4096,
                enable_prefix_caching=False,
                cuda_graphs=graphs,
            )
        )
        assert (engine.runner.graphs is not None) == graphs
        assert engine.runner.kv_cache.numel() > 2**31
        tokens[graphs] = [c.token_ids for c in engine.generate(prompts, params)]
        del engine
        torch.cuda.empty_cache()
    assert tokens[True] == tokens[False]


def test_sliding_window_graphs_match_eager(
    tmp_path: Path, model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Mistral-style model (every layer windowed, W = 48 over 16-token blocks, so blocks
    behind the window return to the pool and their table entries are NULL_BLOCK) decodes
    the same greedy tokens with CUDA graphs as kernel by kernel, and as the torch reference
    kernels do in float32."""
    from pdserve.common.model.fixtures.random import save_random_llama

    path = save_random_llama(
        tmp_path / "mistral",
        num_layers=2,
        hidden_size=256,
        num_heads=8,
        num_kv_heads=2,
        intermediate_size=512,
        sliding_window=48,
        tokenizer_from=model_dir,
    )
    tokens = _graphs_eager_torch(path, monkeypatch)
    assert tokens["graphs"] == tokens["eager"]
    assert tokens["eager"] == tokens["torch"]


def test_mixed_full_and_sliding_groups_graphs_match_eager(
    tmp_path: Path, model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Qwen2 with 2 full and 2 sliding layers (W = 48, 16-token blocks): two KV cache
    groups, each with its own block table (the sliding one holding NULL_BLOCK entries) and
    static graph buffers; graphs, eager Triton and the torch kernels give the same tokens."""
    from pdserve.common.model.fixtures.random import save_random_model

    path = save_random_model(
        tmp_path / "qwen2-mix",
        "qwen2",
        tokenizer_from=model_dir,
        hidden_size=256,
        intermediate_size=512,
        num_attention_heads=8,
        num_key_value_heads=2,
        num_hidden_layers=4,
        use_sliding_window=True,
        sliding_window=48,
        max_window_layers=2,
        max_position_embeddings=4096,
    )
    tokens = _graphs_eager_torch(path, monkeypatch, num_groups=2)
    assert tokens["graphs"] == tokens["eager"]
    assert tokens["eager"] == tokens["torch"]


def _graphs_eager_torch(
    path: Path, monkeypatch: pytest.MonkeyPatch, num_groups: int = 1
) -> dict[str, list[list[int]]]:
    """Greedy tokens of ``path`` with graphs, eager Triton and the torch kernels (fp32)."""
    from pdserve.common.engine.config import EngineConfig
    from pdserve.common.engine.llm_engine import LLMEngine
    from pdserve.common.engine.sampling import SamplingParams

    lens = [1, 20, 47, 48, 49, 200, 333]
    prompts = [[(i * 131 + j * 17) % 40000 + 5 for j in range(n)] for i, n in enumerate(lens)]
    params = SamplingParams(max_tokens=100, ignore_eos=True)
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
                block_size=16,
                num_kv_blocks=256,
                max_num_seqs=8,
                enable_prefix_caching=False,
                cuda_graphs=graphs,
            )
        )
        assert (engine.runner.graphs is not None) == graphs
        assert len(engine.kv_groups) == num_groups
        if engine.runner.graphs is not None:
            assert engine.runner.graphs.num_groups == num_groups
        tokens[name] = [c.token_ids for c in engine.generate(prompts, params)]
        del engine
        torch.cuda.empty_cache()
    return tokens
