"""The speculative method ``dspark``: a DeepSpec DSpark draft (common/model/draft/dspark.py,
common/engine/spec_decode/dspark.py) on random Qwen3 targets, CPU, fp32.

* the draft's forward against figures of DeepSpec's own ``Qwen3DSparkModel`` (commit
  afdfa7c9, transformers 5.10.2 as it pins, run once outside the repository on this very
  checkpoint and these features: the project ships no DeepSpec code);
* the target's hidden states of the layers the draft names against transformers';
* every draft the engine proposed equal to the draft recomputed from scratch over the whole
  sequence (positions, hidden-state alignment, the paged draft KV carried across steps);
* greedy output with k = 5 identical to no speculation: drafts accepted and rejected (a
  Markov head made a bigram table of the target's own output), the confidence head
  shortening blocks, a prefix-cache hit, a rebuild over several steps (proposals deferred
  and counted), a preemption. Sampled: tests/test_spec_sampling.py; disaggregated with PCP 2:
  tests/test_spec_decode_e2e.py (slow).
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from pdserve.common.engine.config import EngineConfig
from pdserve.common.engine.llm_engine import LLMEngine
from pdserve.common.engine.request import Request
from pdserve.common.engine.sampling import SamplingParams
from pdserve.common.engine.spec_decode.config import SpeculativeConfig, parse_speculative_config
from pdserve.common.engine.spec_decode.dspark import DSparkProposer
from pdserve.common.engine.spec_decode.proposal import Draft
from pdserve.common.engine.step_plan import ScheduledSeq, StepPlan
from pdserve.common.errors import ModelLoadError, PdserveError
from pdserve.common.model.draft.dspark import DSparkDraft, load_dspark
from pdserve.common.model.fixtures.random import save_random_model
from pdserve.common.model.fixtures.random_dspark import save_random_dspark

K = 5
VOCAB = 512
PROMPTS = [list(range(100, 150)), [7, 8, 9, 10, 11, 12, 7, 8, 9], [5] * 20]
TARGET = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=False,
)  # fmt: skip


def spec(draft: Path, k: int = K, threshold: float | None = None) -> SpeculativeConfig:
    return SpeculativeConfig(
        method="dspark", model=str(draft), num_speculative_tokens=k, confidence_threshold=threshold
    )


def engine_of(model: Path, sp: SpeculativeConfig | None = None, **kw: Any) -> LLMEngine:
    torch.set_num_threads(1)
    base: dict[str, Any] = dict(model=str(model), block_size=16, num_kv_blocks=512)
    return LLMEngine(EngineConfig(**{**base, **kw}, speculative_config=sp))


def greedy(eng: LLMEngine, prompts: list[list[int]] = PROMPTS, n: int = 32) -> list[list[int]]:
    outs = eng.generate(prompts, SamplingParams(max_tokens=n, ignore_eos=True))
    assert eng.pool.num_free_blocks == eng.pool.num_blocks
    return [o.token_ids for o in outs]


def bigram_draft(path: Path, target: Path, outputs: list[list[int]], **kw: Any) -> Path:
    """A random draft whose Markov head is a bigram table of ``outputs`` (each token to the
    one that most often follows it there; rank: the tokens seen) and whose LM head is near
    zero: its drafts follow the target's own habits, so some are accepted, some rejected."""
    follow: dict[int, Counter[int]] = {}
    for seq in outputs:
        for a, b in zip(seq, seq[1:], strict=False):
            follow.setdefault(a, Counter())[b] += 1
    vocab = json.loads((target / "config.json").read_text())["vocab_size"]
    save_random_dspark(path, target, markov_rank=len(follow), confidence_head=True, **kw)
    state = load_file(path / "model.safetensors")
    w1, w2 = torch.zeros(vocab, len(follow)), torch.zeros(vocab, len(follow))
    for n, (a, c) in enumerate(sorted(follow.items())):
        w1[a, n] = 1.0
        w2[c.most_common(1)[0][0], n] = 20.0
    state["markov_head.markov_w1.weight"] = w1
    state["markov_head.markov_w2.weight"] = w2
    state["lm_head.weight"] = state["lm_head.weight"] * 0.01
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("dspark")
    target = save_random_model(root / "target", "qwen3", seed=0, **TARGET)
    want = greedy(engine_of(target))
    return {
        "target": target,
        "want": want,
        "random": save_random_dspark(
            root / "random", target, num_layers=2, markov_rank=8, confidence_head=True, std=0.1
        ),  # fmt: skip
        "bigram": bigram_draft(root / "bigram", target, want, num_layers=2, std=0.05),
    }


def assert_counters_add_up(eng: LLMEngine, some_accepted: bool = True) -> None:
    assert eng.speculator is not None
    s = eng.speculator.stats
    assert s.num_drafts > 0 and s.num_accepted_tokens <= s.num_draft_tokens <= s.num_drafts * K
    assert (s.num_accepted_tokens > 0) == some_accepted
    assert sum(s.accepted_per_pos) == s.num_accepted_tokens
    assert all(a >= b for a, b in zip(s.accepted_per_pos, s.accepted_per_pos[1:], strict=False))


# -- config --------------------------------------------------------------------------------


def test_config_errors_name_the_problem(models: dict[str, Any], tmp_path: Path) -> None:
    no_model = parse_speculative_config('{"method": "dspark", "num_speculative_tokens": 5}')
    with pytest.raises(ModelLoadError, match="'dspark' needs 'model'.*only a DeepSeek-V4"):
        engine_of(models["target"], no_model)
    with pytest.raises(PdserveError, match="confidence_threshold belongs to method 'dspark'"):
        SpeculativeConfig(method="ngram", num_speculative_tokens=2, confidence_threshold=0.5)
    with pytest.raises(PdserveError, match=r"within \[0, 1\], got 1.5"):
        spec(models["random"], threshold=1.5)
    with pytest.raises(ModelLoadError, match="exceeds its block_size 7"):
        engine_of(models["target"], spec(models["random"], k=8))
    last = save_random_dspark(tmp_path / "last", models["target"], target_layer_ids=[1, 3])
    with pytest.raises(ModelLoadError, match=r"target_layer_ids \[1, 3\].*not the last layer"):
        engine_of(models["target"], spec(last))
    other = tmp_path / "gemma"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"architectures": ["Gemma4DSparkModel"]}))
    with pytest.raises(ModelLoadError, match="'Gemma4DSparkModel' is not supported"):
        engine_of(models["target"], spec(other))


# -- the draft's forward: DeepSpec's figures ----------------------------------------------

# (case, step) -> greedy block tokens, confidence logits, block hidden [0, :4] and [6, -4:],
# the greedy rows' logits at their argmax: DeepSpec's Qwen3DSparkModel on reference_case()
DEEPSPEC: dict[tuple[str, int], dict[str, list[float]]] = {
    ("vanilla", 0): {
        "tokens": [154, 494, 494, 494, 91, 91, 91],
        "confidence": [0.6542248, -0.1845286, -0.3793095, -0.4366683, -0.4883527, -0.2639256, 0.2244136],
        "hidden": [0.6679509, -0.1805349, -0.1748445, 0.5318077, -0.3453443, 1.474609, 0.1780924, 1.948965],
        "top_logits": [2.448819, 2.322788, 2.438843, 2.249874, 2.135998, 2.30957, 2.133653],
    },
    ("vanilla", 1): {
        "tokens": [460, 441, 441, 441, 441, 441, 441],
        "confidence": [0.1435341, -0.1567074, -0.03409907, -0.006387591, 0.2012029, 0.5953618, 0.7884176],
        "hidden": [0.605728, -1.423063, -0.9031878, -1.301416, -0.2187587, 0.8964014, -0.8410386, 2.587929],
        "top_logits": [1.761103, 2.739465, 2.485461, 2.532174, 2.696568, 2.593812, 2.660536],
    },
    ("rnn", 0): {
        "tokens": [146, 494, 494, 494, 494, 91, 275],
        "confidence": [-0.07175232, 0.4375556, 0.5372026, 0.4856426, 0.3526428, 0.3855038, 0.6416236],
        "hidden": [0.6679509, -0.1805349, -0.1748445, 0.5318077, -0.3453443, 1.474609, 0.1780924, 1.948965],
        "top_logits": [2.29535, 2.482733, 2.543842, 2.320904, 2.159616, 2.201093, 2.082771],
    },
    ("rnn", 1): {
        "tokens": [143, 441, 441, 441, 441, 441, 441],
        "confidence": [-0.5887269, 0.2928171, 0.6466059, 0.7743627, 0.6760204, 0.5726646, 0.4856979],
        "hidden": [0.605728, -1.423063, -0.9031878, -1.301416, -0.2187587, 0.8964014, -0.8410386, 2.587929],
        "top_logits": [2.140237, 2.790234, 2.521104, 2.607235, 2.775038, 2.679358, 2.752514],
    },
}  # fmt: skip


def reference_case(root: Path, case: str) -> tuple[DSparkDraft, torch.Tensor, list[int]]:
    """A seeded draft (2 layers, block 7, layers -1, 1, 2 of a 4-layer target, GQA 4/2)
    with no weight drawn by transformers (the figures hold across its versions), seeded
    features [28, 3 * 64] and tokens: contexts [0, 23) then [0, 27)."""
    target = root / "target"
    target.mkdir(parents=True, exist_ok=True)
    cfg = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "rms_norm_eps": 1e-6,
           "max_position_embeddings": 256, "rope_theta": 10000.0, "attention_bias": False,
           **TARGET}  # fmt: skip
    (target / "config.json").write_text(json.dumps(cfg))
    kinds = {
        "vanilla": dict(markov_rank=8, markov_head_type="vanilla", confidence_head=True),
        "rnn": dict(
            markov_rank=8,
            markov_head_type="rnn",
            confidence_head=True,
            confidence_head_with_markov=False,
        ),  # fmt: skip
    }
    path = save_random_dspark(root / case, target, num_layers=2, target_layer_ids=[-1, 1, 2],
                              std=0.1, seed=1, copy_target_head=False, **kinds[case])  # fmt: skip
    gen = torch.Generator().manual_seed(2)
    features = torch.randn(28, 3 * 64, generator=gen)
    tokens = torch.randint(0, VOCAB - 1, (28,), generator=gen).tolist()
    return load_dspark(path, torch.float32, torch.device("cpu")), features, tokens


def draft_from_scratch(
    draft: DSparkDraft, features: torch.Tensor, anchor: int, s: int, n: int
) -> tuple[torch.Tensor, list[int], list[float], list[float]]:
    """The draft over context [0, s) and the block at s, greedy rows 0 .. n-1: (block
    hidden [B, hidden], tokens, confidence logits, each row's logit at its argmax)."""
    kvs = draft.context_kv(features[:s], torch.arange(s))
    h = draft.block(torch.tensor([anchor]), torch.tensor([s]), [[kv] for kv in kvs])[0]
    prev, state = torch.tensor([anchor]), None
    tokens, conf, top = [], [], []
    for j in range(n):
        embed = draft.prev_embed(prev)
        logits, state = draft.row_logits(h[j : j + 1], embed, state)
        c = draft.confidence(h[j : j + 1], embed)
        tokens.append(int(logits[0].argmax()))
        top.append(float(logits[0].max()))
        conf.append(float(c[0]) if c is not None else 0.0)
        prev = torch.tensor(tokens[-1:])
    return h, tokens, conf, top


@pytest.mark.parametrize("case", ["vanilla", "rnn"])
def test_draft_forward_equals_deepspec_figures(tmp_path: Path, case: str) -> None:
    draft, features, tokens = reference_case(tmp_path, case)
    for step, s in enumerate((23, 27)):
        h, toks, conf, top = draft_from_scratch(draft, features, tokens[s], s, 7)
        want = DEEPSPEC[case, step]
        assert toks == want["tokens"]
        for got, ref in ((conf, want["confidence"]), (top, want["top_logits"]),
                         (h[0, :4].tolist() + h[6, -4:].tolist(), want["hidden"])):  # fmt: skip
            assert max(abs(a - b) for a, b in zip(got, ref, strict=True)) < 1e-5, (got, ref)


# -- the target's hidden states; the engine's drafts from scratch --------------------------


def test_target_exposes_the_layers_the_draft_names(models: dict[str, Any]) -> None:
    from transformers import AutoModelForCausalLM

    eng = engine_of(models["target"], spec(models["random"]))
    proposer = eng.speculator.mtp  # type: ignore[union-attr]
    assert isinstance(proposer, DSparkProposer)
    prompt = PROMPTS[0]
    req = Request("x", prompt, SamplingParams())
    req.block_ids = list(range(4))  # the pool is idle: the prompt's KV written by hand
    eng.runner.execute(StepPlan([ScheduledSeq("x", prompt, 0, req.block_ids, True)]))
    [got] = proposer.hidden.of([req], [(0, len(prompt))])  # recomputed from the paged KV
    hf = AutoModelForCausalLM.from_pretrained(models["target"], dtype=torch.float32).eval()
    with torch.no_grad():
        hs = hf(torch.tensor([prompt]), output_hidden_states=True).hidden_states
    ids = proposer.draft.cfg.target_layer_ids
    want = torch.cat([hs[i + 1] for i in ids], -1)[0]
    assert got.shape == want.shape and (got - want).abs().max() < 1e-5


def test_every_engine_draft_equals_the_draft_from_scratch(models: dict[str, Any]) -> None:
    """Catches a position, a hidden state from the wrong layer or step, a stale draft KV."""
    from transformers import AutoModelForCausalLM

    eng = engine_of(models["target"], spec(models["bigram"]), max_num_batched_tokens=16)
    proposer = eng.speculator.mtp  # type: ignore[union-attr]
    assert isinstance(proposer, DSparkProposer)
    seen: list[tuple[list[int], int, list[int]]] = []
    propose = proposer.propose

    def record(reqs: list[Request], seqs: list[ScheduledSeq]) -> list[Draft]:
        drafts = propose(reqs, seqs)
        for r, s, d in zip(reqs, seqs, drafts, strict=True):
            if d.token_ids:
                seen.append((r.all_token_ids, s.start_position, d.token_ids))
        return drafts

    proposer.propose = record  # type: ignore[method-assign]
    assert greedy(eng, PROMPTS[:2], 16) == [w[:16] for w in models["want"][:2]]
    hf = AutoModelForCausalLM.from_pretrained(models["target"], dtype=torch.float32).eval()
    ids = proposer.draft.cfg.target_layer_ids
    assert len(seen) >= 6
    for tokens, s, drafted in seen:
        with torch.no_grad():
            hs = hf(torch.tensor([tokens[:s]]), output_hidden_states=True).hidden_states
        features = torch.cat([hs[i + 1] for i in ids], -1)[0]
        _, want, _, _ = draft_from_scratch(proposer.draft, features, tokens[s], s, len(drafted))
        assert drafted == want


# -- greedy output identical -------------------------------------------------------------


@pytest.mark.parametrize("threshold", [None, 0.4])
def test_greedy_identical_with_accepted_and_rejected_drafts(
    models: dict[str, Any], threshold: float | None
) -> None:
    eng = engine_of(models["target"], spec(models["bigram"], threshold=threshold))
    assert greedy(eng) == models["want"]
    assert_counters_add_up(eng)
    s = eng.speculator.stats  # type: ignore[union-attr]
    assert s.num_accepted_tokens < s.num_draft_tokens  # some rejected, rolled back
    if threshold:  # the head (random) cut some blocks short
        assert s.num_draft_tokens < s.num_drafts * K


def test_greedy_identical_with_a_random_draft(models: dict[str, Any]) -> None:
    eng = engine_of(models["target"], spec(models["random"]))
    assert greedy(eng) == models["want"]
    assert_counters_add_up(eng, some_accepted=False)


def test_prefix_hit_and_rebuild_over_steps_defer_proposals(models: dict[str, Any]) -> None:
    """A prefix-cache hit leaves the draft's state to rebuild from the target's KV; with 16
    positions rebuilt a step a 50-token prompt takes 4 steps without drafts (deferred)."""
    eng = engine_of(models["target"], spec(models["bigram"]), max_num_batched_tokens=16)
    assert greedy(eng, PROMPTS[:1]) == models["want"][:1]
    deferred = eng.speculator.stats.num_deferred  # type: ignore[union-attr]
    assert deferred >= 3
    [again] = eng.generate(PROMPTS[:1], SamplingParams(max_tokens=32, ignore_eos=True))
    assert again.token_ids == models["want"][0]
    assert again.num_cached_tokens >= 48  # the prefix cache served the prompt
    assert eng.speculator.stats.num_deferred >= 2 * deferred  # type: ignore[union-attr]
    assert_counters_add_up(eng)


def test_preemption_keeps_greedy_identical(models: dict[str, Any]) -> None:
    eng = engine_of(models["target"], spec(models["bigram"]), num_kv_blocks=9,
                    max_num_batched_tokens=24)  # fmt: skip
    assert greedy(eng) == models["want"]
    assert eng.scheduler.num_preemptions > 0
    assert_counters_add_up(eng)
