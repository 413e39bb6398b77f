"""Speculative decoding on CUDA (GPU machine): verify steps (k + 1 one-token rows a
sequence, spec_decode/verify_rows.py) replay the decode CUDA graphs, as do plain decode
steps; greedy output must equal the engine's without speculation. fp32, so that a graph
size's different split of the attention sum cannot flip a near tie."""

from __future__ import annotations

import gc
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.gpu_tools import gpu_memory_share

torch = pytest.importorskip("torch")

from pdserve.common.engine.step_plan import StepPlan  # noqa: E402 (after torch's skip)


def verify_rows(plan: StepPlan) -> list[int]:
    """[rows] when a replayed plan is a verify step (a sequence on several one-token rows),
    else []: what the tests count through DecodeGraphs.on_replay."""
    seqs = plan.seqs
    return [len(seqs)] if len({s.request_id for s in seqs}) < len(seqs) else []


pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


@pytest.mark.parametrize("method", ["ngram", "self"])
def test_cuda_speculation_greedy_identical(gpu_llama: Path, method: str) -> None:
    from pdserve.common.engine.config import EngineConfig
    from pdserve.common.engine.llm_engine import LLMEngine
    from pdserve.common.engine.sampling import SamplingParams
    from pdserve.common.engine.spec_decode.config import SpeculativeConfig

    spec = (
        SpeculativeConfig(method="ngram", num_speculative_tokens=5, prompt_lookup_min=2)
        if method == "ngram"
        else SpeculativeConfig(method="draft_model", model=str(gpu_llama), num_speculative_tokens=5)
    )
    prompts = [[(i * 31 + j * 7) % 40000 + 5 for j in range(n)] for i, n in enumerate([1, 63, 300])]
    prompts.append([11, 12, 13, 14] * 30)  # repeats: n-gram drafts get accepted
    params = SamplingParams(max_tokens=40, ignore_eos=True)

    def run(
        spec_config: SpeculativeConfig | None, hook: Callable[[LLMEngine], None] | None = None
    ) -> tuple[list[list[int]], LLMEngine]:
        engine = LLMEngine(
            EngineConfig(model=str(gpu_llama), device="cuda", dtype="float32",
                         gpu_memory_utilization=gpu_memory_share(), speculative_config=spec_config)
        )  # fmt: skip
        if hook is not None:
            hook(engine)
        out = [c.token_ids for c in engine.generate(prompts, params)]
        assert engine.pool.num_free_blocks == engine.pool.num_blocks
        return out, engine

    want, base = run(None)
    assert getattr(base.runner, "graphs", None) is not None  # graphs on for the plain steps
    del base
    torch.cuda.empty_cache()
    replays = []

    def counting(engine: LLMEngine) -> None:
        graphs = engine.runner.graphs  # type: ignore[attr-defined]
        assert graphs is not None
        graphs.on_replay = lambda plan: replays.extend(verify_rows(plan))

    got, engine = run(spec, counting)
    assert got == want
    assert replays, "no verify step replayed a CUDA graph"
    assert engine.speculator is not None
    stats = engine.speculator.stats
    assert 0 < stats.num_accepted_tokens <= stats.num_draft_tokens
    if method == "self":
        # the draft is the target, through other kernels (decode graphs vs verify): a near tie
        # may rarely split them, never more
        assert stats.num_accepted_tokens >= 0.95 * stats.num_draft_tokens


@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "eager"])
@pytest.mark.parametrize("kind", ["dense-echo", "moe-echo"])
def test_cuda_mtp_greedy_identical(
    tmp_path_factory: pytest.TempPathFactory, model_dir: Path, kind: str, graphs: bool
) -> None:
    """Method mtp on CUDA (Triton MLA kernels; the MTP prompt pass writes no KV, slots -1):
    greedy output equal to the engine's without speculation, drafts accepted; with graphs,
    verify steps replay the decode graphs, which hand the MTP layer the target's hidden
    states (cuda_graphs.py keeps them per graph)."""
    from pdserve.common.engine.config import EngineConfig
    from pdserve.common.engine.llm_engine import LLMEngine
    from pdserve.common.engine.sampling import SamplingParams
    from pdserve.common.engine.spec_decode.config import SpeculativeConfig
    from tests.test_mtp_spec import mtp_checkpoint

    # the MoE checkpoint's latent and rope part widened to the Triton MLA kernel's tiles
    # (powers of two >= 16; model_loader.check_device_supports refuses the CPU test's 16/8)
    widen = {"kv_lora_rank": 32, "qk_rope_head_dim": 16} if kind == "moe-echo" else {}
    model = mtp_checkpoint(tmp_path_factory.mktemp("mtp-gpu"), kind.split("-")[0], model_dir,
                           echo=True, **widen)  # fmt: skip
    prompts = [[(i * 31 + j * 7) % 40000 + 5 for j in range(n)] for i, n in enumerate([1, 63, 300])]
    params = SamplingParams(max_tokens=40, ignore_eos=True)

    def run(k: int | None) -> tuple[list[list[int]], tuple[int, int]]:
        spec = None if k is None else SpeculativeConfig(method="mtp", num_speculative_tokens=k)
        engine = LLMEngine(
            EngineConfig(model=str(model), device="cuda", dtype="float32", cuda_graphs=graphs,
                         gpu_memory_utilization=gpu_memory_share(), speculative_config=spec)
        )  # fmt: skip
        replays: list[int] = []
        runner_graphs = getattr(engine.runner, "graphs", None)
        assert (runner_graphs is not None) == graphs
        if runner_graphs is not None:
            runner_graphs.on_replay = lambda plan: replays.extend(verify_rows(plan))
        out = [c.token_ids for c in engine.generate(prompts, params)]
        assert engine.pool.num_free_blocks == engine.pool.num_blocks
        if graphs and k is not None:
            assert replays, "no verify step replayed a CUDA graph"
        counts = (0, 0)
        if k is not None:
            assert engine.speculator is not None
            stats = engine.speculator.stats
            counts = (stats.num_accepted_tokens, stats.num_draft_tokens)
        # each engine takes its share of the device counting what this process holds:
        # the last one's KV cache must be gone before the next engine sizes its own
        del engine, runner_graphs
        gc.collect()
        torch.cuda.empty_cache()
        return out, counts

    want, _ = run(None)
    for k in (1, 3):
        got, (accepted, drafted) = run(k)
        assert got == want, k
        assert 0 < accepted <= drafted


@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "eager"])
def test_cuda_dspark_greedy_identical(
    tmp_path_factory: pytest.TempPathFactory, model_dir: Path, graphs: bool
) -> None:
    """Method dspark (k = 5) on CUDA, a random Qwen3 target with a draft made of its bigrams
    (tests/test_dspark.py): greedy output equal to the engine's without speculation, drafts
    accepted; with graphs, verify steps replay the decode graphs, which hand the draft the
    target's chosen layers (cuda_graphs.py keeps ``CausalLM.hidden`` per graph). The draft's
    own forward runs eagerly (torch SDPA over its gathered context)."""
    from pdserve.common.engine.config import EngineConfig
    from pdserve.common.engine.llm_engine import LLMEngine
    from pdserve.common.engine.sampling import SamplingParams
    from pdserve.common.engine.spec_decode.config import SpeculativeConfig
    from pdserve.common.model.fixtures.random import save_random_model
    from tests.test_dspark import PROMPTS, TARGET, bigram_draft

    root = tmp_path_factory.mktemp("dspark-gpu")
    # the tokenizer of the test model: the GPU machine has no embedded model to copy it from
    model = save_random_model(root / "target", "qwen3", seed=0, tokenizer_from=model_dir, **TARGET)
    params = SamplingParams(max_tokens=40, ignore_eos=True)

    def run(draft: Path | None) -> tuple[list[list[int]], tuple[int, int]]:
        spec = None if draft is None else SpeculativeConfig(
            method="dspark", model=str(draft), num_speculative_tokens=5
        )  # fmt: skip
        engine = LLMEngine(
            EngineConfig(model=str(model), device="cuda", dtype="float32", cuda_graphs=graphs,
                         gpu_memory_utilization=gpu_memory_share(), speculative_config=spec)
        )  # fmt: skip
        replays: list[int] = []
        runner_graphs = getattr(engine.runner, "graphs", None)
        if runner_graphs is not None:
            runner_graphs.on_replay = lambda plan: replays.extend(verify_rows(plan))
        out = [c.token_ids for c in engine.generate(PROMPTS, params)]
        assert engine.pool.num_free_blocks == engine.pool.num_blocks
        if graphs and draft is not None:
            assert replays, "no verify step replayed a CUDA graph"
        counts = (0, 0)
        if draft is not None:
            assert engine.speculator is not None
            stats = engine.speculator.stats
            counts = (stats.num_accepted_tokens, stats.num_draft_tokens)
        del engine, runner_graphs
        gc.collect()
        torch.cuda.empty_cache()
        return out, counts

    want, _ = run(None)
    got, (accepted, drafted) = run(bigram_draft(root / "draft", model, want, num_layers=2))
    assert got == want
    assert 0 < accepted <= drafted


def test_cuda_v4_dspark_graphs_draft_as_eager(
    tmp_path_factory: pytest.TempPathFactory, model_dir: Path
) -> None:
    """Method dspark on a DeepSeek-V4 target (tests/test_dspark_v4.py's random V4 and
    module, k = 5), CUDA, fp32: with graphs every draft equals the eager engine's, and
    greedy output equals the engine's without speculation. The module's drafts come from
    the target's rows (``DeepseekV4Model.hidden_rows``): the proposer recaptures the graphs
    with them kept, and a replay hands them on (cuda_graphs.py), else the windows would
    hold the last eager forward's rows and the drafts would differ."""
    from pdserve.common.engine.config import EngineConfig
    from pdserve.common.engine.llm_engine import LLMEngine
    from pdserve.common.engine.sampling import SamplingParams
    from pdserve.common.engine.spec_decode.config import SpeculativeConfig
    from pdserve.common.model.fixtures.random import save_random_v4
    from tests.test_dspark import PROMPTS
    from tests.test_dspark_v4 import with_dspark

    root = tmp_path_factory.mktemp("dspark-v4-gpu")
    target = save_random_v4(root / "v4", tokenizer_from=model_dir)
    model = with_dspark(target, root / "random")  # random module: drafts read the rows
    params = SamplingParams(max_tokens=40, ignore_eos=True)

    def run(spec: bool, graphs: bool) -> tuple[list[list[int]], list[list[int]], int]:
        sp = SpeculativeConfig(method="dspark", num_speculative_tokens=5) if spec else None
        engine = LLMEngine(
            EngineConfig(model=str(model), device="cuda", dtype="float32", cuda_graphs=graphs,
                         gpu_memory_utilization=gpu_memory_share(), speculative_config=sp)
        )  # fmt: skip
        drafts: list[list[int]] = []
        replays: list[int] = []
        if spec:
            proposer = engine.speculator.mtp  # type: ignore[union-attr]
            propose = proposer.propose

            def record(reqs, seqs):  # type: ignore[no-untyped-def]  # noqa: ANN001, ANN202
                out = propose(reqs, seqs)
                drafts.extend(list(d.token_ids) for d in out)
                return out

            proposer.propose = record
        runner_graphs = getattr(engine.runner, "graphs", None)
        if runner_graphs is not None:
            runner_graphs.on_replay = lambda plan: replays.append(len(plan.seqs))
        out = [c.token_ids for c in engine.generate(PROMPTS, params)]
        assert engine.pool.num_free_blocks == engine.pool.num_blocks
        assert not graphs or replays, "no step replayed a CUDA graph"
        deferred = engine.speculator.stats.num_deferred if spec else 0  # type: ignore[union-attr]
        del engine, runner_graphs
        gc.collect()
        torch.cuda.empty_cache()
        return out, drafts, deferred

    want, _, _ = run(spec=False, graphs=True)
    eager, eager_drafts, _ = run(spec=True, graphs=False)
    got, graph_drafts, deferred = run(spec=True, graphs=True)
    assert eager == want and got == want
    assert any(eager_drafts) and deferred == 0
    assert graph_drafts == eager_drafts
