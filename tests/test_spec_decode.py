"""Speculative decoding (common/engine/spec_decode/): config, proposers, the rejection
sampler's exactness, and the engine's output with speculation equal to its output without.

Greedy: token-identical (and the same text, finish reasons, logprobs, pool state) for
n-gram and draft-model speculation on random checkpoints. The sampled distribution:
tests/test_spec_sampling.py.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import msgspec
import pytest
import torch

from pdserve.common.engine.block_pool import BlockPool
from pdserve.common.engine.config import EngineConfig
from pdserve.common.engine.llm_engine import LLMEngine
from pdserve.common.engine.request import Request
from pdserve.common.engine.sampling import SamplingParams
from pdserve.common.engine.sampling_params import StructuredOutput, TokenLogprobs
from pdserve.common.engine.scheduler import Scheduler
from pdserve.common.engine.spec_decode.config import SpeculativeConfig, parse_speculative_config
from pdserve.common.engine.spec_decode.ngram import ngram_propose
from pdserve.common.errors import ModelLoadError, PdserveError, RequestError
from pdserve.common.model.fixtures.random import save_random_llama
from pdserve.common.runtime.service_config import load_config

SHAPE = dict(hidden_size=64, num_heads=4, num_kv_heads=2, intermediate_size=128)


def ngram(k: int = 5) -> SpeculativeConfig:
    return SpeculativeConfig(
        method="ngram", num_speculative_tokens=k, prompt_lookup_max=4, prompt_lookup_min=2
    )


def draft(model: Path, k: int = 3) -> SpeculativeConfig:
    return SpeculativeConfig(method="draft_model", model=str(model), num_speculative_tokens=k)


def perturbed_copy(src: Path, dst: Path, scale: float) -> Path:
    """The model at ``src`` with noise on its weights: a draft that agrees often, not always
    (an independent random model would agree with the target on almost nothing)."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    gen = torch.Generator().manual_seed(1)
    for f in dst.glob("*.safetensors"):
        state = load_file(f)
        for name, w in state.items():
            if name.endswith("proj.weight"):
                state[name] = w + scale * w.std() * torch.randn(w.shape, generator=gen)
        save_file(state, f, metadata={"format": "pt"})
    return dst


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("spec")
    target = save_random_llama(root / "target", num_layers=2, vocab_size=512, **SHAPE)
    return {
        "target": target,
        "draft": perturbed_copy(target, root / "draft", 0.5),
    }


def engine_of(model: Path, spec: SpeculativeConfig | None = None, **kw: object) -> LLMEngine:
    torch.set_num_threads(1)
    base: dict[str, object] = dict(model=str(model), block_size=16, num_kv_blocks=512)
    return LLMEngine(EngineConfig(**{**base, **kw}, speculative_config=spec))  # type: ignore[arg-type]


PROMPTS = [
    [7, 8, 9, 10, 11, 12, 7, 8, 9, 10, 11, 12, 7, 8, 9],  # repeats: n-gram finds matches
    list(range(100, 150)),
    [5] * 20,
]


# -- config -------------------------------------------------------------------------------


def test_config_errors_name_the_problem() -> None:
    with pytest.raises(PdserveError, match="unknown method 'medusa'"):
        parse_speculative_config('{"method": "medusa", "num_speculative_tokens": 2}')
    with pytest.raises(PdserveError, match="at least 1, got 0"):
        parse_speculative_config('{"method": "ngram", "num_speculative_tokens": 0}')
    with pytest.raises(PdserveError, match="method 'mtp' takes no 'model'"):
        parse_speculative_config('{"method": "mtp", "num_speculative_tokens": 1, "model": "x"}')
    with pytest.raises(PdserveError, match="needs 'model'"):
        parse_speculative_config('{"method": "draft_model", "num_speculative_tokens": 2}')
    with pytest.raises(PdserveError, match="prompt_lookup_min <= prompt_lookup_max"):
        parse_speculative_config(
            '{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 1, '
            '"prompt_lookup_min": 2}'
        )
    with pytest.raises(PdserveError, match="not valid JSON"):
        parse_speculative_config("{method: ngram}")
    with pytest.raises(PdserveError, match="Object contains unknown field `k`"):
        parse_speculative_config('{"method": "ngram", "num_speculative_tokens": 2, "k": 1}')


def test_toml_and_env_reach_decode_not_prefill(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    toml = tmp_path / "c.toml"
    toml.write_text('[engine.speculative_config]\nmethod = "ngram"\nnum_speculative_tokens = 3\n')
    cfg = load_config(toml)
    want = SpeculativeConfig(method="ngram", num_speculative_tokens=3)
    assert cfg.engine_for("decode").speculative_config == want
    assert cfg.engine_for("prefill").speculative_config is None
    monkeypatch.setenv(
        "PDSERVE_ENGINE__SPECULATIVE_CONFIG", '{"method": "ngram", "num_speculative_tokens": 4}'
    )
    spec = load_config(toml).engine_for("decode").speculative_config
    assert spec is not None and spec.num_speculative_tokens == 4


def test_draft_with_another_vocabulary_is_refused(models: dict[str, Path], tmp_path: Path) -> None:
    other = save_random_llama(tmp_path / "v16", num_layers=1, vocab_size=16, **SHAPE)
    with pytest.raises(ModelLoadError, match="vocabulary of 16 tokens, the target 512"):
        engine_of(models["target"], draft(other))


# -- proposers and the scheduler's bookkeeping ----------------------------------------------


def test_ngram_copies_the_latest_match_and_keeps_repeating() -> None:
    text = [1, 2, 3, 4, 1, 2, 3, 4, 1, 2]
    assert ngram_propose(text, 5, 2, 4) == [3, 4, 1, 2, 3]
    assert ngram_propose([9, 1, 2, 8, 1, 2, 5, 1, 2], 3, 2, 4) == [5, 1, 2]  # the latest match
    assert ngram_propose([1, 2, 3, 4], 3, 1, 4) == [4, 4, 4]  # no match: padded to k
    assert ngram_propose([1, 2, 3, 1, 5, 2, 3], 2, 2, 2) == [1, 5]
    assert ngram_propose([1, 2, 3, 1, 5, 2, 3], 2, 3, 4) == [3, 3]  # min 3: no match


def test_rejected_drafts_roll_back_blocks_and_hashes() -> None:
    pool = BlockPool(16)
    sched = Scheduler(pool, 4, 8, 64, num_speculative_tokens=5, max_model_len=64)
    req = Request("r", [1, 2, 3, 4, 5, 6], SamplingParams(max_tokens=20))
    sched.add(req)
    plan, reqs = sched.schedule()
    sched.on_step_done(reqs, plan)
    req.output_token_ids.append(7)  # the first token: 7 tokens, 6 computed
    plan, reqs = sched.schedule()
    [seq] = plan.seqs
    assert (seq.num_drafts, len(seq.token_ids), seq.start_position) == (5, 6, 6)
    assert len(req.block_ids) == 3  # positions up to 11
    # verify: 1 of 5 drafts accepted -> 8 computed, blocks past position 7 freed
    sched.on_step_done(reqs, plan, [4])
    assert req.num_computed_tokens == 8 and len(req.block_ids) == 2
    assert pool.num_free_blocks == 14
    assert req.num_registered_blocks == 1  # only the block the request's tokens fill
    req.output_token_ids += [8, 9]  # the accepted draft and the bonus
    plan, reqs = sched.schedule()
    assert plan.seqs[0].num_drafts == 5  # k again; max_tokens leaves room
    sched.finish(req, "abort")
    assert pool.num_free_blocks == 16
    # max_tokens 3 with one token out: the step may emit two, so one draft only
    short = Request("s", [1, 2, 3], SamplingParams(max_tokens=3))
    sched.add(short)
    plan, reqs = sched.schedule()
    sched.on_step_done(reqs, plan)
    short.output_token_ids.append(4)
    plan, _ = sched.schedule()
    assert plan.seqs[0].num_drafts == 1


# -- the engine: greedy identical, counters add up -----------------------------------------


Result = tuple[list[int], str, str | None, list[TokenLogprobs]]


def run(eng: LLMEngine, params: list[SamplingParams]) -> list[Result]:
    """Every prompt to its end, step by step: tokens, text, finish reason, logprobs."""
    got: dict[str, Result] = {}
    for i, (prompt, p) in enumerate(zip(PROMPTS, params, strict=True)):
        eng.add_request(f"r{i}", prompt, p)
        got[f"r{i}"] = ([], "", None, [])
    while eng.has_unfinished:
        for out in eng.step():
            tokens, text, _, lps = got[out.request_id]
            assert len(out.logprobs) in (0, len(out.new_token_ids))
            got[out.request_id] = (
                tokens + out.new_token_ids,
                text + out.text,
                out.finish_reason,
                lps + out.logprobs,
            )
    assert eng.pool.num_free_blocks == eng.pool.num_blocks
    return [got[f"r{i}"] for i in range(len(PROMPTS))]


def assert_same(ref: list[Result], out: list[Result]) -> None:
    for a, b in zip(ref, out, strict=True):
        assert b[:3] == a[:3]
        assert len(a[3]) == len(b[3])
        for x, y in zip(a[3], b[3], strict=True):
            assert x.token_id == y.token_id and x.top_ids == y.top_ids
            assert abs(x.logprob - y.logprob) < 1e-4


def assert_counters_add_up(eng: LLMEngine) -> None:
    assert eng.speculator is not None
    s = eng.speculator.stats
    assert s.num_drafts > 0 and 0 < s.num_accepted_tokens <= s.num_draft_tokens
    assert s.num_draft_tokens <= s.num_drafts * eng.speculator.k
    assert sum(s.accepted_per_pos) == s.num_accepted_tokens
    assert all(a >= b for a, b in zip(s.accepted_per_pos, s.accepted_per_pos[1:], strict=False))


@pytest.mark.parametrize("method", ["ngram", "draft", "self"])
def test_greedy_output_identical(models: dict[str, Path], method: str) -> None:
    spec = {
        "ngram": ngram(5),
        "draft": draft(models["draft"], 3),
        "self": draft(models["target"], 4),
    }[method]
    params = [SamplingParams(max_tokens=24, logprobs=2)] * len(PROMPTS)
    ref = run(engine_of(models["target"]), params)
    eng = engine_of(models["target"], spec)
    out = run(eng, params)
    assert_same(ref, out)
    assert all(len(r[3]) == len(r[0]) for r in out)
    assert_counters_add_up(eng)
    if method == "self":  # the draft is the target: every draft accepted
        s = eng.speculator.stats  # type: ignore[union-attr]
        assert s.num_accepted_tokens == s.num_draft_tokens


def test_greedy_with_penalties_min_tokens_and_stops(models: dict[str, Path]) -> None:
    base = SamplingParams(max_tokens=20, ignore_eos=True)
    full = engine_of(models["target"]).generate(PROMPTS[:1], base)[0]
    stop = full.text[len(full.text) // 2 : len(full.text) // 2 + 3]
    params = [
        SamplingParams(max_tokens=20, repetition_penalty=1.3, presence_penalty=0.5,
                       logit_bias={full.token_ids[3]: 5.0}, min_tokens=6),
        SamplingParams(max_tokens=20, stop=(stop,), ignore_eos=True),
        SamplingParams(max_tokens=3),  # fewer tokens left than k: fewer drafts
    ]  # fmt: skip
    for spec in (ngram(5), draft(models["draft"], 3)):
        ref = run(engine_of(models["target"]), params)
        out = run(engine_of(models["target"], spec), params)
        assert_same(ref, out)


def test_structured_output_is_refused(models: dict[str, Path]) -> None:
    eng = engine_of(models["target"], ngram(2))
    with pytest.raises(RequestError, match="structured output cannot be combined"):
        eng.add_request(
            "x", [1, 2, 3], SamplingParams(structured=StructuredOutput(kind="regex", spec="a+"))
        )


def test_prefix_cache_holds_only_accepted_tokens(models: dict[str, Path]) -> None:
    eng = engine_of(models["target"], ngram(5))
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    [first] = eng.generate(PROMPTS[:1], params)
    # the whole first answer as a prompt: every full block of it must be a cache hit
    again = PROMPTS[0] + first.token_ids
    [second] = eng.generate([again], SamplingParams(max_tokens=2))
    assert second.num_cached_tokens == (len(again) - 1) // 16 * 16


@pytest.mark.slow
def test_embedded_model_greedy_identical(model_dir: Path) -> None:
    eng = LLMEngine(EngineConfig(model=str(model_dir), speculative_config=ngram(5)))
    story = " ".join(f"Line {i}: the {i}th lantern was lit at dusk." for i in range(12))
    prompts = [
        eng.tokenizer.encode_chat([{"role": "user", "content": "Repeat: red green blue"}]),
        eng.tokenizer.encode(story),  # the model continues the pattern: drafts accepted
    ]
    params = SamplingParams(max_tokens=16)
    out = eng.generate(prompts, params)
    ref = LLMEngine(EngineConfig(model=str(model_dir))).generate(prompts, params)
    assert [(o.token_ids, o.text) for o in out] == [(r.token_ids, r.text) for r in ref]
    assert_counters_add_up(eng)


def test_spec_config_survives_the_wire_to_children() -> None:
    """`pdserve up` hands its children the config as JSON."""
    cfg = load_config(None, engine={"speculative_config": msgspec.to_builtins(ngram(2))})
    again = msgspec.json.decode(msgspec.json.encode(cfg), type=type(cfg))
    assert again.engine_for("decode").speculative_config == ngram(2)
    assert os.environ.get("PDSERVE_ENGINE__SPECULATIVE_CONFIG") is None


def test_counters_reach_the_metrics_text() -> None:
    from pdserve.common.engine.spec_decode.stats import SpecDecodeStats
    from pdserve.common.runtime.metrics import Metrics, render
    from pdserve.common.runtime.spec_metrics import SpecDecodeReporter

    stats = SpecDecodeStats(3)
    metrics = Metrics("decode", 0)
    reporter = SpecDecodeReporter(metrics, stats)
    stats.add(3, 2)
    reporter.report()
    stats.add(3, 3)
    stats.add(2, 0)
    reporter.report()
    reporter.report()  # nothing new: nothing added
    text = render(metrics.samples()).decode()
    labels = 'instance="0",rank="0",service="decode"'

    def per_pos(pos: int) -> str:
        return f'instance="0",position="{pos}",rank="0",service="decode"'

    for line in (
        f"pdserve:spec_decode_num_drafts_total{{{labels}}} 3.0",
        f"pdserve:spec_decode_num_draft_tokens_total{{{labels}}} 8.0",
        f"pdserve:spec_decode_num_accepted_tokens_total{{{labels}}} 5.0",
        f"pdserve:spec_decode_num_accepted_tokens_per_pos_total{{{per_pos(0)}}} 2.0",
        f"pdserve:spec_decode_num_accepted_tokens_per_pos_total{{{per_pos(1)}}} 2.0",
        f"pdserve:spec_decode_num_accepted_tokens_per_pos_total{{{per_pos(2)}}} 1.0",
    ):
        assert line in text, (line, text)


@pytest.mark.parametrize(
    "flag, message",
    [
        ('{"method": "ngram"}', "invalid --speculative-config"),
        ('{"method": "mtp", "num_speculative_tokens": 0}', "at least 1, got 0"),
    ],
)
def test_cli_refuses_a_bad_speculative_config(
    flag: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from pdserve.cli.main import main

    assert main(["generate", "--prompt", "x", "--speculative-config", flag]) == 2
    assert message in capsys.readouterr().err


def test_up_flag_reaches_the_decode_engine_only() -> None:
    from pdserve.cli.deployment import local_config
    from pdserve.cli.main import build_parser
    from pdserve.cli.up import _engine_flags

    flag = '{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 3}'
    args = build_parser().parse_args(["up", "--speculative-config", flag])
    cfg = local_config(engine=_engine_flags(args))
    spec = cfg.engine_for("decode").speculative_config
    assert spec == SpeculativeConfig(method="ngram", num_speculative_tokens=5, prompt_lookup_max=3)
    assert cfg.engine_for("prefill").speculative_config is None


def test_a_verify_becomes_decode_rows() -> None:
    from pdserve.common.engine.spec_decode.verify_rows import as_decode_rows
    from pdserve.common.engine.step_plan import ScheduledSeq, StepPlan

    decode = ScheduledSeq("a", [5], 9, [0], True)
    verify = ScheduledSeq("b", [7, 1, 2], 20, [1, 2], True, num_drafts=2)
    rows = as_decode_rows(StepPlan([decode, verify]))
    assert rows is not None
    assert [(s.request_id, s.token_ids, s.start_position) for s in rows.seqs] == [
        ("a", [5], 9), ("b", [7], 20), ("b", [1], 21), ("b", [2], 22),
    ]  # fmt: skip
    assert rows.num_logits == StepPlan([decode, verify]).num_logits == 4
    assert as_decode_rows(StepPlan([decode])) is None  # no verify: as it is
    chunk = ScheduledSeq("c", [1, 2, 3], 0, [3], False)
    assert as_decode_rows(StepPlan([verify, chunk])) is None  # a prefill chunk: as it is
