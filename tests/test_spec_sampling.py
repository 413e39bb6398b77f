"""Speculative decoding keeps the sampled distribution exact: chi-square tests at
significance 1e-3 -- on the rejection sampler itself with 200,000 draws (a 1% shift of one
token's probability gives a statistic far over the critical value; the test shows it
rejects such a shift), and through the engine on a peaked 16-token model, where wiring
errors (a verify reading the wrong row, a wrong history) show as large biases."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pdserve.common.engine.sampling import SamplingParams
from pdserve.common.engine.spec_decode.config import SpeculativeConfig
from pdserve.common.engine.spec_decode.rejection import rejection_sample
from pdserve.common.model.fixtures.random import save_random_model
from pdserve.common.model.fixtures.random_dspark import save_random_dspark
from tests.test_spec_decode import draft, engine_of, ngram, perturbed_copy

ALPHA = 1e-3  # significance of every chi-square test here


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("spec_sampling")
    # 16 tokens, weights 10x transformers' default scale: peaked next-token distributions
    # that depend on the context (at the default scale they are all near uniform, and a
    # verify reading the wrong row would go unseen)
    small = save_random_model(
        root / "small", "llama", seed=3, vocab_size=16, hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        initializer_range=0.2, tie_word_embeddings=False,
    )  # fmt: skip
    return {
        "small": small,
        "small_draft": perturbed_copy(small, root / "small_draft", 0.5),
        # DSpark (tests/test_dspark.py): drafts from the target's hidden states, the random
        # confidence head cutting some blocks short at threshold 0.5
        "small_dspark": save_random_dspark(root / "small_dspark", small, num_layers=1,
                                           markov_rank=4, confidence_head=True, std=0.2),
    }  # fmt: skip


# -- the rejection sampler is exact ----------------------------------------------------------


def chi_square_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """p-value of counts against probs (cells with probability > 0)."""
    n = counts.sum()
    keep = probs > 0
    assert int(counts[~keep].sum()) == 0, "a token of probability 0 was drawn"
    expected = n * probs[keep]
    stat = ((counts[keep] - expected) ** 2 / expected).sum()
    df = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2), stat / 2))


@pytest.mark.parametrize("point_mass", [False, True])
def test_rejection_sampling_keeps_the_target_distribution(point_mass: bool) -> None:
    gen = torch.Generator().manual_seed(0)
    num, k, vocab = 200_000, 3, 8
    p = torch.rand((k + 1, vocab), generator=gen) ** 3
    p[:, 0] = 0.0  # a token the target never takes
    p /= p.sum(-1, keepdim=True)
    q = torch.rand((k, vocab), generator=gen) ** 3
    q /= q.sum(-1, keepdim=True)
    if point_mass:  # n-gram: the same deterministic draft every trial
        # each position's second most likely token (accepted often, rejected often)
        drafts = p[:k].argsort(-1)[:, -2].expand(num, k)
        draft_probs = None
    else:
        drafts = torch.multinomial(q, num, replacement=True, generator=gen).T  # [N, K]
        draft_probs = q.expand(num, k, vocab)
    accepted, nxt = rejection_sample(
        p.expand(num, k + 1, vocab), drafts, draft_probs, torch.rand((num, k), generator=gen), gen
    )
    first = torch.where(accepted > 0, drafts[:, 0], nxt)
    counts = torch.bincount(first, minlength=vocab).double()
    assert chi_square_p(counts, p[0].double()) > ALPHA
    # the second token, where the first was an accepted draft (tokens independent here)
    mask = accepted > 0
    second = torch.where(accepted[mask] > 1, drafts[mask, 1], nxt[mask])
    assert chi_square_p(torch.bincount(second, minlength=vocab).double(), p[1].double()) > ALPHA
    # the test has the power to see a 1% bias: shift 0.01 of probability between tokens
    biased = p[0].double().clone()
    big, second = biased.topk(2).indices.tolist()
    biased[big] -= 0.01
    biased[second] += 0.01
    assert chi_square_p(counts, biased) < ALPHA


# -- sampled: the distribution through the engine ------------------------------------------


def exact_marginals(model: Path, prompt: list[int], temperature: float) -> torch.Tensor:
    """P(output token 1) and P(output token 2) [2, V] of the model by enumeration (HF)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model, torch_dtype=torch.float32).eval()
    vocab = hf.config.vocab_size

    def next_probs(prefixes: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            logits = hf(prefixes).logits[:, -1].float()
        return (logits / temperature).softmax(-1)

    base = torch.tensor([prompt])
    p0 = next_probs(base)[0]  # [V]
    grid1 = torch.cat([base.expand(vocab, -1), torch.arange(vocab)[:, None]], 1)
    p1 = next_probs(grid1)  # [V, V]: row t0
    grid2 = torch.cat(
        [grid1.repeat_interleave(vocab, 0), torch.arange(vocab).repeat(vocab)[:, None]], 1
    )
    p2 = next_probs(grid2).view(vocab, vocab, vocab)
    m1 = (p0[:, None] * p1).sum(0)
    m2 = (p0[:, None, None] * p1[:, :, None] * p2).sum((0, 1))
    return torch.stack([m1, m2]).double()


def small_v4_dspark(root: Path) -> Path:
    """A 16-token DeepSeek-V4 (common/model/fixtures/random.py's layers, weights at 10x scale) with
    its own random DSpark module (blocks of 3; confidence cutting some at 0.5)."""
    from pdserve.common.model.fixtures.random import RANDOM_V4
    from pdserve.common.model.fixtures.random_dspark import add_random_v4_dspark

    v4 = save_random_model(root / "small_v4", "deepseek_v4", seed=3, vocab_size=16,
                           initializer_range=0.2, **RANDOM_V4)  # fmt: skip
    return add_random_v4_dspark(v4, block_size=3, markov_rank=4, std=0.2)


@pytest.mark.parametrize(
    "method",
    # V4 (its own module, tests/test_dspark_v4.py): ~50 s for its 2,000 requests on 2 cores
    ["ngram", "draft", "dspark", pytest.param("dspark-v4", marks=pytest.mark.slow)],
)
def test_sampled_distribution_unchanged(
    models: dict[str, Path], method: str, tmp_path: Path
) -> None:
    """Output tokens 2 and 3 come out of the first verify step (positions 0 and 1)."""
    target = small_v4_dspark(tmp_path) if method == "dspark-v4" else models["small"]
    spec = {
        "ngram": lambda: ngram(3),
        "draft": lambda: draft(models["small_draft"], 3),
        "dspark": lambda: SpeculativeConfig(method="dspark", model=str(models["small_dspark"]),
                                            num_speculative_tokens=3, confidence_threshold=0.5),
        "dspark-v4": lambda: SpeculativeConfig(method="dspark", num_speculative_tokens=3,
                                               confidence_threshold=0.5),
    }[method]()  # fmt: skip
    prompt = [3, 5, 7, 3, 5]
    eng = engine_of(target, spec, max_num_seqs=512, max_num_batched_tokens=4096,
                    num_kv_blocks=2048, enable_prefix_caching=False)  # fmt: skip
    num = 2000
    # seeded per request: the test is deterministic (max_tokens 4: the first verify has 2
    # drafts, so tokens 2 and 3 are a draft or a resample, or the bonus)
    params = [SamplingParams(max_tokens=4, temperature=0.8, ignore_eos=True, seed=i)
              for i in range(num)]  # fmt: skip
    outs = eng.generate([prompt] * num, params)
    tokens = torch.tensor([o.token_ids for o in outs])  # [N, 4]
    exact = exact_marginals(target, prompt, 0.8)
    for pos in (1, 2):
        counts = torch.bincount(tokens[:, pos], minlength=16).double()
        assert chi_square_p(counts, exact[pos - 1]) > ALPHA, (pos, counts, exact[pos - 1])
    assert eng.speculator is not None
    stats = eng.speculator.stats
    if method == "dspark":  # blocks the confidence head cut to nothing are no drafts
        assert num // 4 <= stats.num_drafts < num and stats.num_accepted_tokens > 0
    elif method == "dspark-v4":  # cut blocks, and second verify steps after accepted ones
        assert stats.num_drafts >= num // 4 and stats.num_accepted_tokens > 0
    else:
        assert stats.num_drafts >= num
