"""The speculative method ``dspark`` on DeepSeek-V4 targets: the checkpoint's own DSpark
module under ``mtp.*`` (common/model/draft/dspark_v4.py, common/engine/spec_decode/dspark_v4.py),
on a random V4 (tests/test_dsv4.py's: sliding, CSA and HCA layers, a window of 16) given a
random module of 3 stages (common/model/fixtures/random_dspark.py add_random_v4_dspark), CPU, fp32.

* the target's features: the streams after the layers the module names, averaged over the
  hyper-connection streams, against transformers' own layer outputs;
* every draft the engine proposed equal to the official forward written out here as the
  reference's ``inference/model.py`` computes it (a ring of the last W context rows per
  stage written at ``pos % W``, the indices ``get_dspark_topk_idxs`` gives, sinks, the
  Markov head fed the token before, greedy);
* greedy output with k = 5 identical to no speculation (drafts accepted and rejected: the
  Markov head made a bigram table of the target's own output; the confidence head cutting
  blocks), a prefix-cache hit (the window refills from fresh rows, proposals deferred and
  counted), a preemption; disaggregated with a PCP 2 prefill (slow);
* what is missing is refused by name.
"""

from __future__ import annotations

import json
import shutil
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from pdserve.common.engine.llm_engine import LLMEngine
from pdserve.common.engine.request import Request
from pdserve.common.engine.sampling import SamplingParams
from pdserve.common.engine.spec_decode.config import SpeculativeConfig
from pdserve.common.engine.spec_decode.dspark_v4 import DSparkV4Proposer
from pdserve.common.engine.spec_decode.proposal import Draft
from pdserve.common.engine.step_plan import ScheduledSeq
from pdserve.common.errors import ModelLoadError
from pdserve.common.model.deepseek.dsv4 import hyper_weights
from pdserve.common.model.deepseek.dsv4_attention import Rope, rms
from pdserve.common.model.draft.dspark_v4 import V4DSparkDraft
from pdserve.common.model.fixtures.random import save_random_v4
from pdserve.common.model.fixtures.random_dspark import add_random_v4_dspark
from tests.test_dspark import PROMPTS, engine_of, greedy

transformers = pytest.importorskip("transformers")

K = 5
STAGES = 3


def spec(
    k: int = K, threshold: float | None = None, model: Path | None = None
) -> SpeculativeConfig:
    return SpeculativeConfig(
        method="dspark",
        num_speculative_tokens=k,
        confidence_threshold=threshold,
        model=None if model is None else str(model),
    )


def with_dspark(target: Path, path: Path, outputs: list[list[int]] | None = None) -> Path:
    """A copy of ``target`` with a random DSpark module; with ``outputs``, its Markov head a
    bigram table of them (each token to the one that most often follows it there, a fourth
    of them off by one), so its drafts follow the target's own habits: some accepted, some
    rejected."""
    shutil.copytree(target, path)
    follow: dict[int, Counter[int]] = {}
    for seq in outputs or []:
        for a, b in zip(seq, seq[1:], strict=False):
            follow.setdefault(a, Counter())[b] += 1
    add_random_v4_dspark(path, num_stages=STAGES, markov_rank=len(follow) or 8)
    if follow:
        state = load_file(path / "mtp.safetensors")
        vocab = json.loads((path / "config.json").read_text())["vocab_size"]
        w1, w2 = torch.zeros(vocab, len(follow)), torch.zeros(vocab, len(follow))
        for n, (a, c) in enumerate(sorted(follow.items())):
            w1[a, n] = 1.0  # every fourth entry wrong: some drafts rejected mid-block
            w2[c.most_common(1)[0][0] + (n % 4 == 3), n] = 20.0
        last = f"mtp.{STAGES - 1}.markov_head"
        state[f"{last}.markov_w1.weight"], state[f"{last}.markov_w2.weight"] = w1, w2
        save_file(state, str(path / "mtp.safetensors"), metadata={"format": "pt"})
    return path


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("dspark_v4")
    target = save_random_v4(root / "v4", tokenizer_from=model_dir)
    want = greedy(engine_of(target))
    return {
        "target": target,
        "want": want,
        "random": with_dspark(target, root / "random"),
        "bigram": with_dspark(target, root / "bigram", want),
    }


def assert_counters_add_up(eng: LLMEngine, some_accepted: bool = True) -> None:
    assert eng.speculator is not None
    s = eng.speculator.stats
    assert s.num_drafts > 0 and s.num_accepted_tokens <= s.num_draft_tokens <= s.num_drafts * K
    assert (s.num_accepted_tokens > 0) == some_accepted
    assert sum(s.accepted_per_pos) == s.num_accepted_tokens


# -- refusals -----------------------------------------------------------------------------


def test_what_is_missing_is_refused_by_name(models: dict[str, Any], tmp_path: Path) -> None:
    with pytest.raises(
        ModelLoadError,
        match="has no DSpark module: config.json lacks "
        "dspark_block_size, dspark_noise_token_id, dspark_target_layer_ids",
    ):
        engine_of(models["target"], spec())
    nextn = shutil.copytree(models["target"], tmp_path / "nextn")  # V4-Flash's own MTP layer
    save_file({"mtp.0.e_proj.weight": torch.zeros(2, 2)}, str(nextn / "mtp.safetensors"))
    with pytest.raises(ModelLoadError, match="are a NextN MTP layer: e_proj, h_proj"):
        engine_of(nextn, spec())
    with pytest.raises(ModelLoadError, match="exceeds its dspark_block_size 5"):
        engine_of(models["random"], spec(k=6))
    cut = shutil.copytree(models["random"], tmp_path / "cut")
    state = load_file(cut / "mtp.safetensors")
    del state["mtp.0.main_proj.weight"]
    state["mtp.1.attn.wq_a.scale"] = torch.ones(1)  # fp8 block scales, as released
    save_file(state, str(cut / "mtp.safetensors"))
    with pytest.raises(ModelLoadError, match=r"quantized DSpark weights .*mtp.1.attn.wq_a.scale"):
        engine_of(cut, spec())
    del state["mtp.1.attn.wq_a.scale"]
    save_file(state, str(cut / "mtp.safetensors"))
    with pytest.raises(ModelLoadError, match=r"missing \['mtp.0.main_proj.weight'\]"):
        engine_of(cut, spec())
    state["mtp.0.main_proj.weight"] = torch.zeros(64, 2 * 64)  # trained on 2 target layers
    save_file(state, str(cut / "mtp.safetensors"))
    with pytest.raises(ModelLoadError, match=r"do not fit this target: mtp.0.main_proj.weight"):
        engine_of(cut, spec())
    # the module of another V4 checkpoint ('model'), for this target
    eng = engine_of(models["target"], spec(model=models["random"]))
    assert isinstance(eng.speculator.mtp, DSparkV4Proposer)  # type: ignore[union-attr]


# -- the target's features; every draft against the official forward ------------------------


def hf_features(target: Path, tokens: list[int], ids: tuple[int, ...]) -> torch.Tensor:
    """[T, L * hidden]: transformers' streams after layers ``ids``, averaged over streams."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    outs: dict[int, torch.Tensor] = {}  # hidden_states' last entry is normed: hooks instead
    for i in ids:
        hf.model.layers[i].register_forward_hook(
            lambda _m, _a, out, i=i: outs.__setitem__(i, out[0] if isinstance(out, tuple) else out)
        )
    with torch.no_grad():
        hf(torch.tensor([tokens]))
    assert outs[ids[0]].dim() == 4  # [1, T, n, hidden]: the streams
    return torch.cat([outs[i][0].mean(dim=1) for i in ids], -1)


def official_block(draft: V4DSparkDraft, features: torch.Tensor, anchor: int, s: int,
                   n: int) -> tuple[torch.Tensor, list[int]]:  # fmt: skip
    """The reference's block at ``s`` after context [0, s), op for op as its
    ``DSparkBlock.forward_embed`` / ``DSparkAttention`` / ``forward_head`` compute it (one
    sequence, start_pos = s - 1): the rows after ``hc_head`` [B, hidden] and n greedy
    drafts."""
    cfg, win, first, last = draft.cfg, draft.cfg.window, draft.first, draft.last
    embed, head = draft.shared
    main_x = first.main_norm(first.main_proj(features[:s]))  # [s, hidden]
    ids = torch.tensor([anchor] + [cfg.mask_token_id] * (cfg.block_size - 1))
    x = embed(ids)[:, None, :].expand(-1, draft.hc_mult, -1).contiguous()  # [B, n, hidden]
    cos, sin = draft.rope.cos_sin(torch.arange(s + cfg.block_size))
    topk = list(range(min(win, s))) + [win + j for j in range(cfg.block_size)]
    for stage in draft.mtp:
        attn = stage.attn
        ring = torch.zeros(win, attn.head_dim)  # kv_cache[:, pos % win] = main_kv
        for p in range(s):
            kv_p = attn.kv_norm(attn.wkv(main_x[p : p + 1]))
            ring[p % win] = Rope.apply(kv_p, cos[p : p + 1], sin[p : p + 1])[0]
        post, comb, h = hyper_weights(x, stage.hc_attn_fn, stage.hc_attn_base,
                                      stage.hc_attn_scale, stage.v4, stage.eps)  # fmt: skip
        h = stage.attn_norm(h)
        bc, bs = cos[s:], sin[s:]
        q = rms(attn.wq_b(attn.q_norm(attn.wq_a(h))).view(len(ids), attn.num_heads, -1), attn.eps)
        q = Rope.apply(q, bc, bs)
        kv = torch.cat([ring, Rope.apply(attn.kv_norm(attn.wkv(h)), bc, bs)])[topk]
        scores = torch.einsum("bhd,kd->hbk", q, kv) * attn.head_dim**-0.5
        scores = torch.cat([scores, attn.attn_sink[:, None, None].expand(-1, len(ids), 1)], -1)
        o = torch.einsum("hbk,kd->bhd", scores.softmax(-1)[..., :-1], kv)
        o = Rope.apply(o, bc, -bs).reshape(len(ids), attn.groups, -1)
        wo_a = attn.wo_a.weight.view(attn.groups, -1, o.shape[-1])
        out = attn.wo_b(torch.einsum("bgd,grd->bgr", o, wo_a).flatten(1))
        x = post[..., None] * out[:, None, :] + torch.matmul(comb.transpose(-1, -2), x)
        post, comb, h = hyper_weights(x, stage.hc_ffn_fn, stage.hc_ffn_base,
                                      stage.hc_ffn_scale, stage.v4, stage.eps)  # fmt: skip
        out = stage.ffn(stage.ffn_norm(h), ids)
        x = post[..., None] * out[:, None, :] + torch.matmul(comb.transpose(-1, -2), x)
    x = last.collapse(x)
    logits = head(last.norm(x))
    out_ids = [anchor]
    for i in range(n):
        bias = last.markov_head.markov_w2(last.markov_head.markov_w1(torch.tensor(out_ids[i])))
        out_ids.append(int((logits[i] + bias).argmax()))
    return x, out_ids[1:]


def test_every_engine_draft_equals_the_official_forward(models: dict[str, Any]) -> None:
    """Catches a context row from the wrong layer, step or position, a window one off."""
    eng = engine_of(models["bigram"], spec(), max_num_batched_tokens=16)
    proposer = eng.speculator.mtp  # type: ignore[union-attr]
    assert isinstance(proposer, DSparkV4Proposer)
    seen: list[tuple[list[int], int, list[int], torch.Tensor]] = []
    propose, block = proposer.propose, proposer.draft.block
    rows: list[torch.Tensor] = []

    def record_block(*args: Any) -> torch.Tensor:
        rows[:] = list(block(*args))  # [B, hidden] of each proposing sequence
        return torch.stack(rows)

    def record(reqs: list[Request], seqs: list[ScheduledSeq]) -> list[Draft]:
        rows.clear()
        drafts = propose(reqs, seqs)
        got = iter(rows)
        for r, s, d in zip(reqs, seqs, drafts, strict=True):
            if d.token_ids:
                seen.append((r.all_token_ids, s.start_position, d.token_ids, next(got)))
        return drafts

    proposer.propose = record  # type: ignore[method-assign]
    proposer.draft.block = record_block  # type: ignore[method-assign]
    assert greedy(eng, PROMPTS[:2], 12) == [w[:12] for w in models["want"][:2]]
    assert len(seen) >= 4 and any(s > 16 for _, s, _, _ in seen)  # beyond the window of 16
    ids = proposer.draft.cfg.target_layer_ids
    assert ids == (1, 2, 3)  # the last layer's output too, as V4-Flash's [40, 41, 42]
    with torch.no_grad():
        for tokens, s, drafted, got in seen:
            features = hf_features(models["bigram"], tokens[:s], ids)
            want, tokens_ = official_block(proposer.draft, features, tokens[s], s, len(drafted))
            assert tokens_ == drafted
            assert (got - want).abs().max() < 1e-5


# -- greedy output identical -------------------------------------------------------------


@pytest.mark.parametrize("threshold", [None, 0.5])
def test_greedy_identical_with_accepted_and_rejected_drafts(
    models: dict[str, Any], threshold: float | None
) -> None:
    eng = engine_of(models["bigram"], spec(threshold=threshold))
    assert greedy(eng) == models["want"]
    assert_counters_add_up(eng)
    s = eng.speculator.stats  # type: ignore[union-attr]
    assert s.num_accepted_tokens < s.num_draft_tokens  # some rejected, rolled back
    assert s.num_deferred == 0  # the prompts' rows filled the windows
    if threshold:  # the head (random) cut some blocks short
        assert s.num_draft_tokens < s.num_drafts * K


def test_greedy_identical_with_a_random_module(models: dict[str, Any]) -> None:
    eng = engine_of(models["random"], spec())
    assert greedy(eng) == models["want"]
    assert_counters_add_up(eng, some_accepted=False)


def test_prefix_hit_defers_until_the_window_refills(models: dict[str, Any]) -> None:
    """The second run of a prompt hits the prefix cache: its rows never went through this
    request's forward, so the window (16) fills from fresh rows first, its verify steps
    without drafts (counted), then drafts resume; the tokens are the same."""
    eng = engine_of(models["bigram"], spec())
    assert greedy(eng, PROMPTS[:1]) == models["want"][:1]
    stats = eng.speculator.stats  # type: ignore[union-attr]
    assert stats.num_deferred == 0
    drafts = stats.num_drafts
    [again] = eng.generate(PROMPTS[:1], SamplingParams(max_tokens=32, ignore_eos=True))
    assert again.token_ids == models["want"][0]
    assert again.num_cached_tokens >= 48  # the prefix cache served the prompt
    assert stats.num_deferred >= 8 and stats.num_drafts > drafts
    assert eng.pool.num_free_blocks == eng.pool.num_blocks


def test_preemption_keeps_greedy_identical(models: dict[str, Any]) -> None:
    eng = engine_of(models["bigram"], spec(), num_kv_blocks=40, max_num_batched_tokens=24)
    assert greedy(eng) == models["want"]
    assert eng.scheduler.num_preemptions > 0
    assert_counters_add_up(eng)


@pytest.mark.slow
def test_disaggregated_with_a_pcp2_prefill(
    tmp_path: Path, models: dict[str, Any], model_dir: Path
) -> None:
    """`pdserve up`: prefill PCP 2 (never runs the module), decode TP 1 with dspark k = 5:
    decode's windows fill from the rows it computes after the pull (deferred meanwhile),
    then it drafts; tokens equal the monolithic engine's without speculation, the counters
    add up in /metrics, pools full after."""
    import asyncio

    from pdserve.services.router.client import AsyncClient
    from tests.e2e import deployment
    from tests.test_serving import assert_pools_full
    from tests.test_spec_decode_e2e import counter, per_position

    n = 40  # past the 16 deferred steps
    want = greedy(engine_of(models["target"]), PROMPTS, n)
    model = with_dspark(models["target"], tmp_path / "model", want)
    engine = {"speculative_config": {"method": "dspark", "num_speculative_tokens": K},
              "kv_cache_memory_gb": 0.05}  # fmt: skip
    with deployment(tmp_path / "dep", model, pcp=2, engine=engine) as dep:

        async def run() -> list[list[int]]:
            async with AsyncClient(dep.cfg.front_address) as client:
                results = await asyncio.gather(
                    *(
                        client.generate(
                            prompt_token_ids=p, max_tokens=n, temperature=0.0, ignore_eos=True
                        )  # fmt: skip
                        for p in PROMPTS
                    )
                )
            return [r.token_ids for r in results]

        assert asyncio.run(run()) == want
        drafts = counter(dep.url, "pdserve:spec_decode_num_drafts")
        accepted = counter(dep.url, "pdserve:spec_decode_num_accepted_tokens")
        assert drafts > 0 and accepted > 0
        # each window filled within W = 16 steps of its pull, then the drafts came
        assert 0 < counter(dep.url, "pdserve:spec_decode_num_deferred") <= 16 * len(PROMPTS)
        assert sum(per_position(dep.url).values()) == accepted
        assert_pools_full(dep.url)
