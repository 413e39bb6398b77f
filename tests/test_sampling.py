"""Sampler: greedy, temperature, top-k, top-p, per-request seeds; parameter validation."""

import pytest
import torch

from pdserve.common.engine.sampling import Sampler, SamplingParams, sample_row
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
