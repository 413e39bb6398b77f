"""Sampler: greedy, temperature, top-k, top-p, per-request seeds; parameter validation."""

from typing import Any

import pytest
import torch

from pdserve.common.engine.sampling import (
    Sampler,
    SamplingParams,
    adjust_logits,
    batch_probs,
    exponential_race,
    row_probs,
    sample_row,
    token_logprobs,
)
from pdserve.common.errors import RequestError


def test_greedy_is_argmax_per_row() -> None:
    logits = torch.randn(4, 50)
    out = Sampler()(logits, [SamplingParams()] * 4, [0] * 4)
    assert out == logits.argmax(-1).tolist()


def test_same_seed_same_tokens_regardless_of_batch_neighbours() -> None:
    logits = torch.randn(3, 100)
    p = SamplingParams(temperature=1.0, seed=7)
    alone = Sampler()(logits[1:2], [p], [3])[0]
    batched = Sampler()(
        logits, [SamplingParams(temperature=0.5, seed=1), p, SamplingParams()], [0, 3, 5]
    )
    assert batched[1] == alone


def test_top_k_one_and_tiny_top_p_are_greedy() -> None:
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        row = torch.randn(100)
        best = int(row.argmax())
        assert sample_row(row, SamplingParams(temperature=2.0, top_k=1), gen) == best
        assert sample_row(row, SamplingParams(temperature=2.0, top_p=1e-6), gen) == best


def test_top_k_and_top_p_only_draw_from_the_allowed_set() -> None:
    gen = torch.Generator().manual_seed(0)
    row = torch.tensor([5.0, 4.0, 3.0, -10.0, -10.0, -10.0])
    drawn = {sample_row(row, SamplingParams(temperature=1.0, top_k=2), gen) for _ in range(200)}
    assert drawn == {0, 1}
    # softmax: p0 ~ 0.665, p1 ~ 0.245; top_p 0.8 keeps exactly the first two.
    drawn = {sample_row(row, SamplingParams(temperature=1.0, top_p=0.8), gen) for _ in range(200)}
    assert drawn == {0, 1}


def test_temperature_sampling_follows_the_distribution() -> None:
    gen = torch.Generator().manual_seed(0)
    row = torch.log(torch.tensor([0.7, 0.2, 0.1]))
    counts = torch.bincount(
        torch.tensor([sample_row(row, SamplingParams(temperature=1.0), gen) for _ in range(3000)]),
        minlength=3,
    )
    freqs = counts.float() / counts.sum()
    assert torch.allclose(freqs, torch.tensor([0.7, 0.2, 0.1]), atol=0.03)


def test_batched_rows_have_each_rows_own_distribution() -> None:
    """An unseeded step's rows are drawn together (Sampler: ``draw_batch``): each row's
    distribution is what ``row_probs`` gives it alone, whatever its neighbours ask."""
    torch.manual_seed(0)
    logits = torch.randn(6, 40) * 3
    params = [
        SamplingParams(temperature=0.7),
        SamplingParams(temperature=1.0, top_k=3),
        SamplingParams(temperature=1.3, top_p=0.5),
        SamplingParams(temperature=1.0, min_p=0.2),
        SamplingParams(temperature=0.5, top_k=10, top_p=0.9, min_p=0.05),
        SamplingParams(temperature=2.0, top_k=40),  # k = the vocabulary: off
    ]
    together = batch_probs(logits, params)
    for row, p in enumerate(params):
        assert torch.allclose(together[row], row_probs(logits[row], p), atol=1e-6), p


def test_unseeded_rows_drawn_together_follow_their_distributions() -> None:
    torch.manual_seed(0)
    row = torch.log(torch.tensor([0.7, 0.2, 0.1, 0.0]))
    gap = torch.log(torch.tensor([0.5, 0.0, 0.3, 0.2]))  # a token of probability 0 between
    logits = torch.stack([row, row, torch.tensor([5.0, 4.0, 3.0, -10.0]), gap])
    params = [SamplingParams(temperature=1.0), SamplingParams(temperature=1.0, seed=3),
              SamplingParams(temperature=1.0, top_k=2), SamplingParams(temperature=1.0)]  # fmt: skip
    sampler = Sampler()
    draws = torch.tensor([sampler(logits, params, [0] * 4) for _ in range(3000)])  # [N, 4]
    assert not sampler.failed_rows
    freqs = torch.bincount(draws[:, 0], minlength=4).float() / len(draws)
    assert torch.allclose(freqs, torch.tensor([0.7, 0.2, 0.1, 0.0]), atol=0.03)
    freqs = torch.bincount(draws[:, 3], minlength=4).float() / len(draws)
    assert torch.allclose(freqs, torch.tensor([0.5, 0.0, 0.3, 0.2]), atol=0.03)
    assert freqs[1] == 0
    assert set(draws[:, 2].tolist()) == {0, 1}  # top-k 2 of that row alone
    # the seeded row still draws its n-th token from its own generator: always the same
    assert len(set(draws[:, 1].tolist())) == 1


def test_the_device_draw_follows_the_distribution() -> None:
    """CUDA's batched draw (exponential_race, run here on CPU tensors): the frequencies of
    each row's distribution, never a token of probability 0."""
    torch.manual_seed(0)
    probs = torch.tensor([[0.7, 0.2, 0.1, 0.0], [0.5, 0.0, 0.3, 0.2]]).repeat(4000, 1)
    drawn = exponential_race(probs).view(4000, 2)
    for row in range(2):
        freqs = torch.bincount(drawn[:, row], minlength=4).float() / 4000
        assert torch.allclose(freqs, probs[row], atol=0.03)
        assert freqs[probs[row] == 0].sum() == 0


def test_a_batched_row_that_is_no_distribution_fails_alone() -> None:
    logits = torch.randn(3, 20)
    logits[1, 4] = float("nan")
    sampler = Sampler()
    params = [SamplingParams(temperature=1.0, top_k=5)] * 3
    tokens = sampler(logits, params, [0, 0, 0])
    assert list(sampler.failed_rows) == [1]
    assert "not finite" in sampler.failed_rows[1]
    assert tokens[1] == -1 and all(0 <= tokens[i] < 20 for i in (0, 2))


@pytest.mark.parametrize(
    "params, message",
    [
        (SamplingParams(max_tokens=0), "max_tokens"),
        (SamplingParams(max_tokens=-3), "max_tokens"),
        (SamplingParams(temperature=-1), "temperature"),
        (SamplingParams(top_p=0.0), "top_p"),
        (SamplingParams(top_k=-5), "top_k"),
        (SamplingParams(stop=("",)), "stop"),
    ],
)
def test_invalid_parameters_are_refused(params: SamplingParams, message: str) -> None:
    with pytest.raises(RequestError, match=message):
        params.validate()


# -- logit adjustments: penalties, logit_bias, min_tokens, min_p ------------------------------


def test_repetition_penalty_divides_positive_and_multiplies_negative_seen_logits() -> None:
    row = torch.tensor([2.0, -1.0, 3.0, 0.5])
    p = SamplingParams(repetition_penalty=2.0)
    out = adjust_logits(row, p, prompt=[0], output=[1], eos_token_ids=frozenset())
    assert out.tolist() == [1.0, -2.0, 3.0, 0.5]  # HF's RepetitionPenaltyLogitsProcessor
    # greedy picks from the adjusted row: token 2 stays best, then 0 was best before
    row = torch.tensor([3.0, 2.0, 0.0])
    assert Sampler()(row[None], [p], [1], [([0], [0])]) == [1]  # 3/2 = 1.5 < 2


def test_frequency_and_presence_penalties_count_output_tokens_only() -> None:
    row = torch.zeros(5)
    p = SamplingParams(frequency_penalty=0.5, presence_penalty=1.0)
    out = adjust_logits(row, p, prompt=[4, 4, 4], output=[1, 1, 2], eos_token_ids=frozenset())
    assert out.tolist() == [0.0, -2.0, -1.5, 0.0, 0.0]


def test_logit_bias_steers_greedy_and_sampled_rows() -> None:
    row = torch.tensor([5.0, 0.0, 0.0])
    greedy = SamplingParams(logit_bias={2: 100.0})
    sampled = SamplingParams(temperature=1.0, seed=3, logit_bias={2: 100.0, 0: -100.0})
    assert Sampler()(torch.stack([row, row]), [greedy, sampled], [0, 0], [((), ())] * 2) == [2, 2]


def test_min_tokens_bans_eos_and_stop_tokens_until_reached() -> None:
    row = torch.tensor([9.0, 8.0, 1.0])  # 0 is EOS, 1 a stop token
    p = SamplingParams(min_tokens=2, stop_token_ids=(1,))
    sampler = Sampler(eos_token_ids=frozenset({0}))
    assert sampler(row[None], [p], [1], [([5], [2])]) == [2]  # one generated: banned
    assert sampler(row[None], [p], [2], [([5], [2, 2])]) == [0]  # two: allowed again
    ignoring = SamplingParams(min_tokens=2, ignore_eos=True)
    assert sampler(row[None], [ignoring], [0], [([5], [])]) == [0]  # EOS is no stop then


def test_min_p_only_draws_likely_enough_tokens() -> None:
    gen = torch.Generator().manual_seed(0)
    row = torch.log(torch.tensor([0.5, 0.3, 0.1, 0.1]))
    p = SamplingParams(temperature=1.0, min_p=0.5)  # keeps p >= 0.25
    assert {sample_row(row, p, gen) for _ in range(300)} == {0, 1}


@pytest.mark.parametrize(
    "params, message",
    [
        (SamplingParams(presence_penalty=2.5), "presence_penalty"),
        (SamplingParams(frequency_penalty=-3), "frequency_penalty"),
        (SamplingParams(repetition_penalty=0), "repetition_penalty"),
        (SamplingParams(min_p=1.5), "min_p"),
        (SamplingParams(min_tokens=20, max_tokens=10), "min_tokens"),
        (SamplingParams(logit_bias={3: 101.0}), "logit_bias"),
    ],
)
def test_invalid_adjustments_are_refused(params: SamplingParams, message: str) -> None:
    with pytest.raises(RequestError, match=message):
        params.validate()


def test_token_ids_outside_the_vocabulary_are_refused() -> None:
    with pytest.raises(RequestError, match="logit_bias: token id 100"):
        SamplingParams(logit_bias={100: 1.0}).validate(vocab_size=100)
    with pytest.raises(RequestError, match="stop_token_ids: token id 7"):
        SamplingParams(stop_token_ids=(7,)).validate(vocab_size=5)


def test_token_logprobs_are_the_raw_log_softmax() -> None:
    logits = torch.randn(3, 40)
    params = [SamplingParams(logprobs=3, repetition_penalty=1.5, temperature=0.7),
              SamplingParams(), SamplingParams(logprobs=0)]  # fmt: skip
    tokens = [5, 6, 7]
    out = token_logprobs(logits, params, tokens)
    want = torch.log_softmax(logits, -1)
    assert out[1] is None
    assert out[0].token_id == 5 and abs(out[0].logprob - float(want[0, 5])) < 1e-6
    top = want[0].topk(3)
    assert out[0].top_ids == top.indices.tolist()  # before penalties and temperature
    assert torch.allclose(torch.tensor(out[0].top_logprobs), top.values)
    assert out[2].top_ids == [] and abs(out[2].logprob - float(want[2, 7])) < 1e-6


def test_structured_output_constrains_every_token(model_dir: Any) -> None:
    pytest.importorskip("xgrammar")
    import json

    from pdserve.common.engine.sampling_params import StructuredOutput
    from pdserve.common.engine.structured import GrammarTable
    from pdserve.common.model.checkpoint.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_dir(model_dir)
    vocab = 49152
    grammars = GrammarTable(model_dir, vocab)
    sampler = Sampler(frozenset(tokenizer.eos_token_ids), grammars)
    choice = StructuredOutput(kind="choice", spec=json.dumps(["yes", "no way"]))
    p = SamplingParams(temperature=1.0, seed=1, structured=choice)
    gen = torch.Generator().manual_seed(0)
    output: list[int] = []
    while not output or output[-1] not in tokenizer.eos_token_ids:
        logits = torch.randn(1, vocab, generator=gen)
        output += sampler(logits, [p], [len(output)], [([1], output)], ["r1"])
        assert len(output) < 10
    assert tokenizer.decode(output) in ("yes", "no way")
    # a second matcher (decode) made mid-way first replays the tokens sampled elsewhere
    grammars.prune([])
    schema = StructuredOutput(kind="json", spec=json.dumps({"enum": ["alpha", "beta"]}))
    q = SamplingParams(structured=schema)
    first = tokenizer.encode('"', add_special_tokens=False)
    logits = torch.randn(1, vocab, generator=gen)
    token = sampler(logits, [q], [1], [([1], first)], ["r2"])[0]
    assert tokenizer.decode([*first, token]) in ('"a', '"al', '"alpha', '"b', '"be', '"beta')
    with pytest.raises(RequestError, match="does not compile"):
        grammars.compile(StructuredOutput(kind="json", spec="{not json"))


def test_structured_output_holds_after_the_thinking(model_dir: Any) -> None:
    """A reasoning model's grammar (StructuredOutput.think_*): free while it thinks, held
    from the token after the end marker; with a start marker, the first step allows it
    beside the grammar's first tokens, and a first token that is not it starts the answer."""
    pytest.importorskip("xgrammar")
    import json

    from pdserve.common.engine.sampling_params import StructuredOutput
    from pdserve.common.engine.structured import GrammarTable
    from pdserve.common.model.checkpoint.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_dir(model_dir)
    vocab = 49152
    sampler = Sampler(frozenset(tokenizer.eos_token_ids), GrammarTable(model_dir, vocab))
    [start], [end], [free] = (tokenizer.encode(w, add_special_tokens=False)
                              for w in ("Let", " ok", " sky"))  # fmt: skip
    choice = json.dumps(["yes", "no way"])
    spec = StructuredOutput(kind="choice", spec=choice, think_end_id=end, think_start_id=start)
    p = SamplingParams(structured=spec)
    gen = torch.Generator().manual_seed(0)

    def step(output: list[int], rid: str, favour: int, shun: int | None = None) -> int:
        logits = torch.randn(1, vocab, generator=gen)
        logits[0, favour] = 100.0
        if shun is not None:
            logits[0, shun] = -100.0
        return sampler(logits, [p], [len(output)], [([1], output)], [rid])[0]

    output: list[int] = []
    for favour in (start, free, free, end):  # it opens its thinking; inside it, anything
        output.append(step(output, "r1", favour))
    assert output == [start, free, free, end]
    while output[-1] not in tokenizer.eos_token_ids:
        output.append(step(output, "r1", free))  # " sky" is no longer allowed
        assert len(output) < 12
    assert tokenizer.decode(output[4:]) in ("yes", "no way")
    # a first token that is not the start marker: the grammar holds from the first token
    first = step([], "r2", free, shun=start)
    assert tokenizer.decode([first]) in ("y", "ye", "yes", "n", "no", "no way")
    # decode's matcher, made mid-way, takes only the tokens after the end marker
    thinking = [start, free, end, *tokenizer.encode("no", add_special_tokens=False)]
    token = step(thinking, "r3", free)
    assert "no way".startswith(tokenizer.decode([*thinking[3:], token]))
