"""Asynchronous scheduling (common/engine/async_steps.py) on CPU: the same tokens as
synchronous steps, whatever ends, fails or is preempted while a step is in flight, and
every block back in the pool. (On CUDA it is the default; tests/test_gpu_serving.py and
the GPU engine tests run it there.)"""

from __future__ import annotations

from pathlib import Path

import pytest

from pdserve.common.engine.block_pool import BlockPool
from pdserve.common.engine.config import EngineConfig
from pdserve.common.engine.llm_engine import LLMEngine
from pdserve.common.engine.model_runner import ModelRunner
from pdserve.common.engine.request import PENDING_TOKEN
from pdserve.common.engine.sampling import SamplingParams

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the mountains, there lived an old clockmaker who",
    "2 + 2 = 4. 3 + 5 =",
]


def engine(model_dir: Path, async_scheduling: bool, **kw: object) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(model_dir), async_scheduling=async_scheduling, **kw))


def params() -> list[SamplingParams]:
    """Lengths that end on different steps, a stop string, a one-token request, and
    rows the host must sample (logprobs, seeded temperature) beside plain greedy ones."""
    return [
        SamplingParams(max_tokens=24, ignore_eos=True),
        SamplingParams(max_tokens=7, ignore_eos=True, logprobs=2),
        SamplingParams(max_tokens=20, stop=[")"]),
        SamplingParams(max_tokens=17, ignore_eos=True, temperature=0.8, seed=3),
        SamplingParams(max_tokens=1, ignore_eos=True),
    ]


def run(eng: LLMEngine, sampling: list[SamplingParams]) -> list[tuple[list[int], str, str]]:
    ids = [eng.tokenizer.encode(p) for p in PROMPTS]
    out = [(c.token_ids, c.text, c.finish_reason or "") for c in eng.generate(ids, sampling)]
    assert not eng.has_unfinished
    assert eng.pool.num_free_blocks == eng.pool.num_blocks
    assert eng.pool.num_fenced == 0
    return out


@pytest.mark.parametrize(
    "small",
    [False, True],
    ids=["roomy", "preempting"],  # 4 blocks of 16 tokens: requests preempt each other
)
def test_async_steps_give_the_synchronous_tokens(model_dir: Path, small: bool) -> None:
    kw = {"num_kv_blocks": 4, "block_size": 16, "max_num_batched_tokens": 32} if small else {}
    sync, overlapped = engine(model_dir, False, **kw), engine(model_dir, True, **kw)
    assert overlapped.is_async_scheduling and not sync.is_async_scheduling
    greedy = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (30, 7, 19, 25, 1)]
    for sampling in (greedy, params()):
        assert run(overlapped, sampling) == run(sync, sampling)
    if small:
        assert overlapped.scheduler.num_preemptions > 0


def test_unseeded_temperature_rows_are_drawn_on_the_device_a_step_ahead(model_dir: Path) -> None:
    """OpenAI's default (temperature 1, no seed) is drawn with the step's greedy rows and
    read a step late, like them: top-k 1 (the draw that must be the argmax) gives the
    synchronous greedy tokens, and no step of such rows waits for the host sampler."""
    sync, overlapped = engine(model_dir, False), engine(model_dir, True)
    lengths = (30, 7, 19, 25, 1)
    greedy = [SamplingParams(max_tokens=n, ignore_eos=True) for n in lengths]
    drawn = [SamplingParams(max_tokens=n, ignore_eos=True, temperature=1.0, top_k=1)
             for n in lengths]  # fmt: skip
    launched = []
    step = overlapped.step

    def counted() -> list:
        out = step()
        launched.append(overlapped._in_flight is not None)
        return out

    overlapped.step = counted  # type: ignore[method-assign]
    assert run(overlapped, drawn) == run(sync, greedy)
    runner = overlapped.runner
    assert isinstance(runner, ModelRunner)  # on CPU every step is eager (no CUDA graphs)
    assert runner.num_eager_steps == launched.count(True) and runner.num_graph_steps == 0
    # every step that computed something left its tokens on the device
    assert launched.count(True) >= max(lengths) - 1
    free = [SamplingParams(max_tokens=12, ignore_eos=True, temperature=1.0, top_p=0.9)] * 5
    assert [len(tokens) for tokens, _, _ in run(overlapped, free)] == [12] * 5


def test_an_abort_while_a_step_is_in_flight(model_dir: Path) -> None:
    eng = engine(model_dir, True)
    ids = [eng.tokenizer.encode(p) for p in PROMPTS[:2]]
    for i, prompt in enumerate(ids):
        eng.add_request(f"r{i}", prompt, SamplingParams(max_tokens=20, ignore_eos=True))
    seen: dict[str, list[int]] = {"r0": [], "r1": []}
    while not seen["r0"] or not seen["r1"]:
        for out in eng.step():
            seen[out.request_id] += out.new_token_ids
    for out in eng.step():  # r0's next token is on the device now, a placeholder here
        seen[out.request_id] += out.new_token_ids
    req = next(r for r in eng.scheduler.running if r.request_id == "r0")
    assert req.output_token_ids[-1] == PENDING_TOKEN
    held = req.held_block_ids
    aborted = eng.abort("r0")
    assert aborted is not None and aborted.finish_reason == "abort"
    # the step in flight may still write r0's blocks: the pool holds them back till it ends
    assert eng.pool.num_fenced >= len(held)
    finished = {}
    while eng.has_unfinished:
        for out in eng.step():
            assert out.request_id == "r1"  # nothing of r0 comes after its abort
            seen["r1"] += out.new_token_ids
            if out.finished:
                finished[out.request_id] = out
    assert len(seen["r1"]) == 20 and finished["r1"].finish_reason == "length"
    assert eng.pool.num_free_blocks == eng.pool.num_blocks and eng.pool.num_fenced == 0


def test_a_failed_step_fails_the_requests_it_held(model_dir: Path) -> None:
    eng = engine(model_dir, True)
    prompt = eng.tokenizer.encode(PROMPTS[0])
    eng.add_request("a", prompt, SamplingParams(max_tokens=10, ignore_eos=True))
    while not eng.step():
        pass
    eng.step()  # a's next token in flight
    execute = eng.runner.execute

    def broken(*args: object) -> object:
        raise RuntimeError("device lost")

    eng.runner.execute = broken  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="device lost"):
        eng.step()
    eng.runner.execute = execute  # type: ignore[method-assign]
    assert eng.take_failures() == [("a", "a step failed: device lost")]
    assert not eng.has_unfinished
    assert eng.pool.num_free_blocks == eng.pool.num_blocks and eng.pool.num_fenced == 0


def test_the_pool_holds_frees_under_a_fence_until_the_step_is_done() -> None:
    pool = BlockPool(4)
    a, b = pool.allocate(2), pool.allocate(1)
    waited: list[bool] = []
    pool.wait_idle = lambda: waited.append(True)
    pool.fence = 1
    pool.free(a)
    pool.fence = 2
    pool.free(b)
    assert pool.num_free_blocks == 1 and pool.num_fenced == 3
    pool.unfence(upto=1)  # step 1 is done, step 2 may still run
    assert pool.num_free_blocks == 3 and pool.num_fenced == 1
    pool.settle()  # short of blocks: wait for the device, then free the rest
    assert waited == [True] and pool.num_free_blocks == 4 and pool.num_fenced == 0
    pool.settle()  # nothing held: no wait
    assert waited == [True]


def test_async_scheduling_defaults_to_the_device() -> None:
    assert EngineConfig(device="cuda").is_async_scheduling
    assert not EngineConfig(device="cpu").is_async_scheduling
    assert EngineConfig(device="cpu", async_scheduling=True).is_async_scheduling
    assert not EngineConfig(device="cuda", async_scheduling=False).is_async_scheduling
