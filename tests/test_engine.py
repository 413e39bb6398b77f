"""The monolithic engine on the embedded model, against Hugging Face transformers.

Logit tolerance: both sides run float32 on CPU with the same dequantised weights; the
only differences are summation orders (paged gather + SDPA vs HF's contiguous SDPA,
batched vs single GEMMs). Observed max |diff| is ~5e-5 on logits of magnitude ~25; 1e-3
leaves room for other BLAS paths while any real fault (RoPE, norm, masking, a wrong
block) moves logits by far more than 0.1.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from pdserve.common.engine.config import EngineConfig
from pdserve.common.engine.llm_engine import LLMEngine
from pdserve.common.engine.sampling import SamplingParams

pytestmark = pytest.mark.slow

LOGIT_ATOL = 1e-3

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "def fibonacci(n):",
    "Translate to German: The weather is nice today.",
    "List three prime numbers greater than 100.",
    "Why is the sky blue? Answer briefly.",
    "Once upon a time, in a small village by the mountains, there lived an old clockmaker who",
    "2 + 2 = 4. 3 + 5 =",
]


@pytest.fixture(scope="module")
def engine(real_model_dir: Path) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(real_model_dir)))


@pytest.fixture(autouse=True)
def pool_returns_to_full(request: pytest.FixtureRequest) -> Iterator[None]:
    yield
    if "engine" in request.fixturenames:
        eng = request.getfixturevalue("engine")
        assert eng.pool.num_free_blocks == eng.pool.num_blocks
        assert not eng.has_unfinished


@pytest.fixture(scope="module")
def hf_model(real_model_dir: Path) -> torch.nn.Module:
    transformers = pytest.importorskip("transformers")
    return transformers.AutoModelForCausalLM.from_pretrained(
        real_model_dir, dtype=torch.float32
    ).eval()


def prompt_ids(engine: LLMEngine) -> list[list[int]]:
    tok = engine.tokenizer
    chat = [tok.encode_chat([{"role": "user", "content": p}]) for p in PROMPTS[:4]]
    raw = [tok.encode(p) for p in PROMPTS[4:]]
    return chat + raw


def hf_agrees_greedy(
    hf_model: torch.nn.Module, eos: set[int], ids: list[int], got: list[int], num: int
) -> None:
    """``got`` is what HF's greedy search gives for ``ids`` (``num`` tokens at most,
    stopping at EOS and keeping it), checked in one teacher-forced forward: the argmax at
    every position of ``ids + got`` is the next token of ``got``. Greedy search is exactly
    that rule applied token by token, without a forward per token."""
    assert got and len(got) <= num
    assert not eos & set(got[:-1]), "went on past an EOS"
    assert len(got) == num or got[-1] in eos, "stopped early without an EOS"
    with torch.no_grad():
        logits = hf_model(torch.tensor([ids + got[:-1]])).logits[0, len(ids) - 1 :]
    assert logits.argmax(-1).tolist() == got


def test_greedy_tokens_identical_to_transformers(
    engine: LLMEngine, hf_model: torch.nn.Module
) -> None:
    prompts = prompt_ids(engine)
    assert len({len(p) for p in prompts}) > 4  # varied lengths
    ours = engine.generate(prompts, SamplingParams(max_tokens=32))  # all 8 batched together
    eos = set(engine.tokenizer.eos_token_ids)
    for prompt, got in zip(prompts, ours, strict=True):
        hf_agrees_greedy(hf_model, eos, prompt, got.token_ids, 32)
    assert sum(len(c.token_ids) == 32 for c in ours) >= 4  # most run the full length


def test_logits_close_to_transformers(engine: LLMEngine, hf_model: torch.nn.Module) -> None:
    from pdserve.common.engine.step_plan import ScheduledSeq, StepPlan

    prompts = prompt_ids(engine)
    blocks = engine.pool.allocate(8)
    try:
        for ids in prompts:
            plan = StepPlan([ScheduledSeq("logits", ids, 0, blocks, True)])
            ours = engine.runner.execute(plan)[0]
            with torch.no_grad():
                ref = hf_model(torch.tensor([ids])).logits[0, -1]
            assert (ours - ref).abs().max().item() < LOGIT_ATOL
    finally:
        engine.pool.free(blocks)


def test_a_batch_gives_each_request_its_solo_tokens(engine: LLMEngine) -> None:
    prompts = prompt_ids(engine)
    sampling = SamplingParams(max_tokens=12, ignore_eos=True)
    solo = [engine.generate([p], sampling)[0].token_ids for p in prompts]
    batched = engine.generate(prompts, sampling)
    assert [c.token_ids for c in batched] == solo


def test_chunked_prefill_and_preemption_give_the_same_tokens(
    real_model_dir: Path, engine: LLMEngine
) -> None:
    prompts = prompt_ids(engine)
    sampling = SamplingParams(max_tokens=24, ignore_eos=True)
    expected = [c.token_ids for c in engine.generate(prompts, sampling)]
    # 16-token blocks, 9 of them, 24-token steps: prompts (9-41 tokens) are chunked and the
    # pool (144 tokens for 8 sequences of up to 65) runs dry: 4 preemptions.
    tight = LLMEngine(
        EngineConfig(
            model=str(real_model_dir),
            block_size=16,
            num_kv_blocks=9,
            max_num_batched_tokens=24,
        )
    )
    got = tight.generate(prompts, sampling)
    assert [c.token_ids for c in got] == expected
    assert tight.scheduler.num_preemptions > 0
    assert tight.pool.num_free_blocks == tight.pool.num_blocks


def test_prefix_cache_hit_computes_fewer_tokens_for_the_same_answer(engine: LLMEngine) -> None:
    tok = engine.tokenizer
    long_context = " ".join(f"Fact {i}: the number {i} squared is {i * i}." for i in range(40))
    ids = tok.encode_chat([{"role": "user", "content": long_context + " What is 7 squared?"}])
    assert len(ids) > 3 * engine.config.block_size
    sampling = SamplingParams(max_tokens=8)
    engine.pool.reset_prefix_cache()
    before = engine.scheduler.num_computed_tokens
    miss = engine.generate([ids], sampling)[0]
    computed_miss = engine.scheduler.num_computed_tokens - before
    before = engine.scheduler.num_computed_tokens
    hit = engine.generate([ids], sampling)[0]
    computed_hit = engine.scheduler.num_computed_tokens - before
    assert hit.token_ids == miss.token_ids
    assert miss.num_cached_tokens == 0
    assert hit.num_cached_tokens == (len(ids) - 1) // 64 * 64
    assert computed_hit == computed_miss - hit.num_cached_tokens


def test_seeded_sampling_is_reproducible(engine: LLMEngine) -> None:
    [ids] = prompt_ids(engine)[:1]
    p = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.95, top_k=50, seed=1234)
    first = engine.generate([ids], p)[0].token_ids
    other = engine.generate([ids, ids], [SamplingParams(max_tokens=16, temperature=1.0, seed=1), p])
    assert other[1].token_ids == first


def test_stop_string_and_stop_token(engine: LLMEngine) -> None:
    ids = engine.tokenizer.encode("The days of the week are Monday, Tuesday,")
    full = engine.generate([ids], SamplingParams(max_tokens=24, ignore_eos=True))[0]
    assert "Thursday" in full.text, full.text
    cut = engine.generate([ids], SamplingParams(max_tokens=24, stop=("Thursday",)))[0]
    assert cut.finish_reason == "stop"
    assert cut.text == full.text[: full.text.index("Thursday")]
    stop_id = full.token_ids[5]
    by_id = engine.generate([ids], SamplingParams(max_tokens=24, stop_token_ids=(stop_id,)))[0]
    assert by_id.token_ids == full.token_ids[: full.token_ids.index(stop_id) + 1]
    assert by_id.finish_reason == "stop"


def test_eos_ends_a_chat_answer(engine: LLMEngine) -> None:
    ids = engine.tokenizer.encode_chat(
        [{"role": "user", "content": "What is the capital of France?"}]
    )
    out = engine.generate([ids], SamplingParams(max_tokens=64))[0]
    assert out.finish_reason == "stop"
    assert "Paris" in out.text
