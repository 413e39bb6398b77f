"""The speculative method ``mtp``: DeepSeek's multi-token-prediction layer drafting
(common/model/draft/mtp_layer.py, common/engine/spec_decode/mtp.py), on random DeepSeek-V3
checkpoints of transformers' classes with an MTP layer written in (tests/test_mla_mtp.py).

* the layer's arithmetic against a reference composed of transformers' own classes
  (``DeepseekV3DecoderLayer``, ``DeepseekV3RMSNorm``, the target's hidden states before its
  final norm taken from ``DeepseekV3ForCausalLM``): hidden states and logits equal;
* every draft the engine proposed equals the reference's draft recomputed from scratch
  over the whole sequence (alignment of tokens, hidden states and positions; the paged
  KV carried across steps, rolled back after rejections);
* greedy output with ``mtp`` equal to the output without speculation (k = 1 and 3, dense
  and MoE), the acceptance counters adding up, drafts accepted on a checkpoint made to
  repeat (an MTP layer that copies its input token, a target that often repeats).
"""

from __future__ import annotations

import json
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
from pdserve.common.engine.spec_decode.mtp import MTPProposer
from pdserve.common.engine.spec_decode.proposal import Draft
from pdserve.common.engine.step_plan import ScheduledSeq
from pdserve.common.errors import ModelLoadError, PdserveError
from pdserve.common.model.fixtures.random import save_random_llama, save_random_model
from tests.test_mla import build_mla
from tests.test_mla_mtp import add_extra_layer
from tests.test_moe_deepseek import DEEPSEEK_MODEL

transformers = pytest.importorskip("transformers")

Proposal = tuple[list[int], list[int], list[torch.Tensor] | None]

PROMPTS = [[(i * 31 + 7) % 30000 + 100 for i in range(n)] for n in (5, 40)]
MAX_TOKENS = 16


def mtp_checkpoint(
    root: Path, kind: str, tokenizer_from: Path, echo: bool = False, **overrides: Any
) -> Path:
    """A random DeepSeek-V3 checkpoint (``dense`` or ``moe``) with its MTP layer written in.
    ``echo``: the target's LM head made its embedding plus noise (it repeats its input token
    now and then) and the MTP layer close to copying its input token, so drafts get
    accepted; otherwise the MTP layer is random (drafts rarely accepted). ``overrides``:
    config keys of the ``moe`` checkpoint over tests/test_moe_deepseek.py's."""
    if kind == "dense":
        model = build_mla(root, "v3-yarn", tokenizer_from=tokenizer_from)
    else:
        model = save_random_model(
            root / "moe", "deepseek_v3", max_position_embeddings=4096, seed=1,
            tokenizer_from=tokenizer_from, **{**DEEPSEEK_MODEL, **overrides},
        )  # fmt: skip
    cfg = json.loads((model / "config.json").read_text())
    index, hidden = cfg["num_hidden_layers"], cfg["hidden_size"]
    add_extra_layer(model, index)
    [path] = sorted(model.glob("*.safetensors"))
    state = load_file(path)
    p = f"model.layers.{index}."
    if not echo:  # its attention's output made to weigh: a position's error shows in logits
        state[p + "self_attn.o_proj.weight"] *= 30
    else:
        embed = state["model.embed_tokens.weight"]
        state["lm_head.weight"] = embed + 3 * state["lm_head.weight"]
        # mostly the input token's embedding, some of the hidden state (its alignment shows)
        mix = torch.randn(hidden, hidden, generator=torch.Generator().manual_seed(5))
        state[p + "eh_proj.weight"] = torch.cat((torch.eye(hidden), 0.5 * mix / hidden**0.5), 1)
        state[p + "shared_head.head.weight"] = embed.clone()
        for k in [k for k in state if k.startswith(p) and k.endswith(("o_proj.weight", "down_proj.weight"))]:  # fmt: skip
            state[k] = state[k] * 0.1
    save_file(state, path, metadata={"format": "pt"})
    return model


class Reference:
    """The MTP layer composed of transformers' classes, drafting from scratch."""

    def __init__(self, model: Path) -> None:
        from transformers import AutoConfig, AutoModelForCausalLM
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RMSNorm

        cfg = AutoConfig.from_pretrained(model)
        self.index = index = cfg.num_hidden_layers
        self.target = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
        # transformers builds layer `index` of a model one layer deeper and loads it by name
        big_cfg = AutoConfig.from_pretrained(model)
        big_cfg.num_hidden_layers = index + 1
        sparse = any(".mlp.experts." in k for k in load_file(next(model.glob("*.safetensors"))))
        if not sparse:
            big_cfg.first_k_dense_replace = index + 1
        big = AutoModelForCausalLM.from_pretrained(model, config=big_cfg, dtype=torch.float32)
        self.layer = big.model.layers[index].eval()
        tensors = {
            k.split(f"model.layers.{index}.", 1)[1]: v
            for f in model.glob("*.safetensors")
            for k, v in load_file(f).items()
            if k.startswith(f"model.layers.{index}.")
        }

        def norm(name: str) -> Any:
            n = DeepseekV3RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
            n.weight.data = tensors[name]
            return n

        self.enorm, self.hnorm = norm("enorm.weight"), norm("hnorm.weight")
        self.head_norm = norm("shared_head.norm.weight")
        self.eh_proj = tensors["eh_proj.weight"]
        self.head = tensors["shared_head.head.weight"]
        self.embed = tensors["embed_tokens.weight"]

    @torch.no_grad()
    def target_hidden(self, ids: list[int]) -> torch.Tensor:  # [T, hidden] before the norm
        seen: list[torch.Tensor] = []
        hook = self.target.model.norm.register_forward_hook(lambda m, a, o: seen.append(a[0]))
        try:
            self.target(torch.tensor([ids]))
        finally:
            hook.remove()
        return seen[0][0]

    @torch.no_grad()
    def mtp(self, next_ids: list[int], hidden: torch.Tensor) -> torch.Tensor:
        """h' at positions 0..n-1 from t_{i+1} = next_ids[i] and h_i = hidden[i]."""
        n = len(next_ids)
        e = self.embed[torch.tensor(next_ids)]
        e = self.enorm(torch.cat((torch.zeros_like(e[:1]), e[1:])))  # position 0's zeroed
        x = torch.cat((e, self.hnorm(hidden)), dim=-1) @ self.eh_proj.T
        positions = torch.arange(n)[None]
        rope = self.target.model.rotary_emb(x[None], positions)
        mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
        out = self.layer(x[None], attention_mask=mask, position_ids=positions,
                         position_embeddings=rope)  # fmt: skip
        return (out[0] if isinstance(out, tuple) else out)[0]

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.head_norm(h) @ self.head.T

    def drafts(self, tokens: list[int], k: int) -> tuple[list[int], list[torch.Tensor]]:
        """The k drafts after ``tokens`` (t_0..t_s) and their logits, each further one from
        the layer's own previous output."""
        h = self.target_hidden(tokens[:-1])  # h_0..h_{s-1}
        next_ids = tokens[1:]
        out: list[int] = []
        logits: list[torch.Tensor] = []
        for _ in range(k):
            hp = self.mtp(next_ids, h)
            logits.append(self.logits(hp[-1]))
            out.append(int(logits[-1].argmax()))
            next_ids = [*next_ids, out[-1]]
            h = torch.cat((h, hp[-1:]))
        return out, logits

    def check(self, seen: list[Proposal]) -> None:
        """Each proposal's drafts are the reference's, and so are the logits they came from
        (those of proposals for one request alone, where a logits row is that request's)."""
        for tokens, drafts, logits in seen:
            want, want_logits = self.drafts(tokens, len(drafts))
            assert drafts == want, len(tokens)
            if logits is not None:
                for got, row in zip(logits, want_logits, strict=True):
                    torch.testing.assert_close(got[0], row, rtol=1e-5, atol=1e-5)


def engine(model: Path, k: int | None, **kw: Any) -> LLMEngine:
    torch.set_num_threads(1)
    spec = None if k is None else SpeculativeConfig(method="mtp", num_speculative_tokens=k)
    return LLMEngine(
        EngineConfig(model=str(model), kv_cache_memory_gb=0.05, speculative_config=spec, **kw)
    )


def greedy(eng: LLMEngine) -> list[list[int]]:
    outs = eng.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS))
    assert eng.pool.num_free_blocks == eng.pool.num_blocks
    return [o.token_ids for o in outs]


def proposer(eng: LLMEngine) -> MTPProposer:
    assert eng.speculator is not None and eng.speculator.mtp is not None
    return eng.speculator.mtp


def record(mtp: MTPProposer) -> list[Proposal]:
    """(the request's tokens, its drafts, the logits of each draft step where the proposal
    was for one request alone) of every proposal from now on."""
    seen: list[Proposal] = []
    propose, logits_of = mtp.propose, mtp.layer.logits
    steps: list[torch.Tensor] = []

    def logits(hidden: torch.Tensor) -> torch.Tensor:
        out = logits_of(hidden)
        steps.append(out.clone())
        return out

    def recording(reqs: list[Request], seqs: list[ScheduledSeq]) -> list[Draft]:
        steps.clear()
        drafts = propose(reqs, seqs)
        alone = list(steps) if len(reqs) == 1 else None
        seen.extend(
            (r.all_token_ids, d.token_ids, alone) for r, d in zip(reqs, drafts, strict=True)
        )
        return drafts

    mtp.propose = recording  # type: ignore[method-assign]
    mtp.layer.logits = logits  # type: ignore[method-assign]
    return seen


def assert_counters_add_up(eng: LLMEngine, accepted: bool) -> None:
    assert eng.speculator is not None
    s = eng.speculator.stats
    assert s.num_drafts > 0 and s.num_accepted_tokens <= s.num_draft_tokens
    assert s.num_draft_tokens <= s.num_drafts * eng.speculator.k
    assert sum(s.accepted_per_pos) == s.num_accepted_tokens
    assert all(a >= b for a, b in zip(s.accepted_per_pos, s.accepted_per_pos[1:], strict=False))
    if accepted:
        assert s.num_accepted_tokens > 0


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("mtp")
    return {
        "dense": mtp_checkpoint(root / "dense", "dense", model_dir),
        "moe": mtp_checkpoint(root / "moe", "moe", model_dir),
        "dense-echo": mtp_checkpoint(root / "dense-echo", "dense", model_dir, echo=True),
        "moe-echo": mtp_checkpoint(root / "moe-echo", "moe", model_dir, echo=True),
    }


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_mtp_layer_matches_transformers(checkpoints: dict[str, Path], kind: str) -> None:
    model = checkpoints[kind]
    ref = Reference(model)
    eng = engine(model, 1)
    mtp = proposer(eng)
    prompt = PROMPTS[1]
    eng.add_request("r", prompt, SamplingParams(max_tokens=4))
    eng.step()  # the prompt's prefill: its KV in the target's cache, one token sampled
    req = eng.scheduler.running[0]
    tokens = req.all_token_ids  # t_0..t_P
    n = len(prompt)
    [hidden] = mtp.hidden.of([req], [(0, n)])  # from the target's paged KV
    want_hidden = ref.target_hidden(tokens[:-1])
    torch.testing.assert_close(hidden, want_hidden, rtol=1e-5, atol=1e-5)
    seq = ScheduledSeq("r", tokens[1:], 0, req.block_ids, True)
    out = mtp.run_layer([seq], [hidden])  # [n, hidden]: h'_0..h'_{n-1}
    want = ref.mtp(tokens[1:], want_hidden)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(mtp.layer.logits(out), ref.logits(want), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind, k", [("dense", 1), ("dense", 3), ("moe", 3)])
def test_drafts_match_the_reference_and_greedy_is_unchanged(
    checkpoints: dict[str, Path], kind: str, k: int
) -> None:
    model = checkpoints[kind]
    want = greedy(engine(model, None))
    eng = engine(model, k)
    seen = record(proposer(eng))
    assert greedy(eng) == want
    assert_counters_add_up(eng, accepted=False)
    assert len(seen) > MAX_TOKENS // 2
    check_alone(model, k, seen)


def check_alone(model: Path, k: int, seen: list[Proposal]) -> None:
    """``seen`` and the proposals of an engine serving one request (whose logits rows are
    compared too) against the reference."""
    alone = engine(model, k)
    seen_alone = record(proposer(alone))
    alone.generate(PROMPTS[1:], SamplingParams(max_tokens=MAX_TOKENS))
    Reference(model).check(seen + seen_alone)


@pytest.mark.parametrize("kind, k", [("dense-echo", 1), ("dense-echo", 3), ("moe-echo", 5)])
def test_greedy_unchanged_with_drafts_accepted(
    checkpoints: dict[str, Path], kind: str, k: int
) -> None:
    model = checkpoints[kind]
    want = greedy(engine(model, None))
    eng = engine(model, k)
    seen = record(proposer(eng))
    assert greedy(eng) == want
    assert_counters_add_up(eng, accepted=True)
    stats = eng.speculator.stats  # type: ignore[union-attr]
    assert stats.num_accepted_tokens < stats.num_draft_tokens  # rejections rolled back too
    if k > 1:  # a step that accepted some of its drafts, not all
        assert stats.accepted_per_pos[0] > stats.accepted_per_pos[-1] > 0
    check_alone(model, k, seen)


def test_config_validation_names_the_problem() -> None:
    spec = parse_speculative_config('{"method": "mtp", "num_speculative_tokens": 5}')
    assert spec.num_speculative_tokens == 5
    for bad in ("0", "-2"):
        with pytest.raises(PdserveError, match=f"at least 1, got {bad}"):
            parse_speculative_config(f'{{"method": "mtp", "num_speculative_tokens": {bad}}}')
    with pytest.raises(PdserveError, match="invalid --speculative-config"):
        parse_speculative_config('{"method": "mtp"}')
    with pytest.raises(PdserveError, match="method 'mtp' takes no 'model'"):
        parse_speculative_config('{"method": "mtp", "num_speculative_tokens": 1, "model": "m"}')
    with pytest.raises(PdserveError, match="prompt_lookup_max/min belong to method 'ngram'"):
        parse_speculative_config(
            '{"method": "mtp", "num_speculative_tokens": 1, "prompt_lookup_max": 3}'
        )


def test_a_checkpoint_without_mtp_layers_is_refused(tmp_path: Path, model_dir: Path) -> None:
    # V3's config declares one MTP layer by default; a checkpoint may still leave it out
    plain = build_mla(tmp_path / "plain", "v3-yarn", tokenizer_from=model_dir)
    with pytest.raises(ModelLoadError, match=r"declares num_nextn_predict_layers=1 but holds "
                       r"no tensors of its MTP layer \(model\.layers\.2\.\*\)"):  # fmt: skip
        engine(plain, 1)
    raw = json.loads((plain / "config.json").read_text())
    (plain / "config.json").write_text(json.dumps({**raw, "num_nextn_predict_layers": 0}))
    with pytest.raises(ModelLoadError, match="has no multi-token-prediction layer"):
        engine(plain, 1)
    llama = save_random_llama(tmp_path / "llama", num_layers=1, hidden_size=64, num_heads=4,
                              num_kv_heads=2, intermediate_size=128, vocab_size=512)  # fmt: skip
    with pytest.raises(ModelLoadError, match="num_nextn_predict_layers is 0 or absent"):
        engine(llama, 2)


def test_sampled_requests_run_and_repeat_with_their_seed(checkpoints: dict[str, Path]) -> None:
    """Sampled drafting (the MTP layer's distribution handed to the rejection sampler, whose
    exactness tests/test_spec_sampling.py checks): a seeded request gives the same tokens
    twice, the counters add up."""
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8, top_p=0.9, seed=7)
    outs = []
    for _ in range(2):
        eng = engine(checkpoints["dense-echo"], 3)
        outs.append([o.token_ids for o in eng.generate(PROMPTS, params)])
        assert eng.pool.num_free_blocks == eng.pool.num_blocks
        assert_counters_add_up(eng, accepted=False)
    assert outs[0] == outs[1]
    assert all(len(t) == MAX_TOKENS for t in outs[0])


def test_the_benchmarks_random_mtp_layer_loads_and_drafts(tmp_path: Path, model_dir: Path) -> None:
    """``bench engine --shape dsv3`` with method mtp: common/model/fixtures/random_mtp.py adds the
    layer (without its own embedding and head: the target's serve) to a checkpoint of
    write_random_deepseek's; here at a tiny size, greedy output unchanged."""
    from pdserve.common.model.fixtures.random_mtp import add_random_mtp_layer
    from pdserve.common.model.fixtures.random_shapes import write_random_deepseek

    model = write_random_deepseek(
        tmp_path / "dsv3", num_layers=2, hidden_size=64, num_heads=4, intermediate_size=128,
        q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
        v_head_dim=8, dtype="float32", tokenizer_from=model_dir,
    )  # fmt: skip
    want = greedy(engine(model, None))
    add_random_mtp_layer(model)
    assert add_random_mtp_layer(model) == model / "mtp.safetensors"  # written once
    eng = engine(model, 2)
    mtp = proposer(eng)
    assert mtp.layer.embed_tokens is eng.runner.model.model.embed_tokens  # type: ignore[attr-defined]
    assert mtp.layer.shared_head.head is eng.runner.model.lm_head  # type: ignore[attr-defined]
    assert greedy(eng) == want
    assert_counters_add_up(eng, accepted=False)


def test_a_long_prompt_catches_up_in_pieces(checkpoints: dict[str, Path]) -> None:
    """With max_num_batched_tokens 16 the 40-token prompt's hidden states and the MTP
    layer's prompt KV are computed in forwards of at most 16 tokens: same drafts as the
    reference over the whole sequence, greedy unchanged."""
    model = checkpoints["dense"]
    want = greedy(engine(model, None, max_num_batched_tokens=16))
    eng = engine(model, 3, max_num_batched_tokens=16)
    mtp = proposer(eng)
    sizes: list[int] = []
    target = eng.runner.model  # type: ignore[attr-defined]
    hidden_states, run_layer = target.hidden_states, mtp.run_layer

    def sized(ids: torch.Tensor, *args: Any) -> torch.Tensor:
        sizes.append(ids.shape[0])
        return hidden_states(ids, *args)

    def layer_sized(seqs: list[ScheduledSeq], hidden: list[torch.Tensor]) -> torch.Tensor:
        sizes.append(sum(len(s.token_ids) for s in seqs))
        return run_layer(seqs, hidden)

    target.hidden_states = sized
    mtp.run_layer = layer_sized  # type: ignore[method-assign]
    seen = record(mtp)
    assert greedy(eng) == want
    assert max(sizes) <= 16 * len(PROMPTS) and sizes.count(16) >= 4, sizes
    Reference(model).check(seen[:6])
