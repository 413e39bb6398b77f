"""The sampler (pure torch): logits to tokens, each row with its own parameters."""

from __future__ import annotations

import torch

from pdserve.common.engine.sampling_params import SamplingParams

__all__ = ["Sampler", "SamplingParams", "sample_row", "token_generator"]


class Sampler:
    """logits [S, V] -> one token id per row, each row with its own parameters.

    A seeded request draws its n-th token from a generator seeded by (seed, n), so the
    draw does not depend on which process samples it: prefill samples the first token,
    decode the rest, and the tokens equal the monolithic engine's.
    """

    def __call__(
        self, logits: torch.Tensor, params: list[SamplingParams], num_generated: list[int]
    ) -> list[int]:
        tokens = logits.argmax(dim=-1).tolist()
        for row, (p, n) in enumerate(zip(params, num_generated, strict=True)):
            if not p.is_greedy:
                tokens[row] = sample_row(logits[row], p, token_generator(p.seed, n, logits.device))
        return tokens


def token_generator(seed: int | None, index: int, device: torch.device) -> torch.Generator:
    gen = torch.Generator(device=device)
    if seed is None:
        gen.seed()
    else:
        gen.manual_seed((seed * 1_000_003 + index) % 2**63)
    return gen


def sample_row(logits: torch.Tensor, p: SamplingParams, gen: torch.Generator) -> int:
    logits = logits.float() / p.temperature  # [V]
    if p.top_k > 0 and p.top_k < logits.shape[-1]:
        kth = torch.topk(logits, p.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=False)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        drop_sorted = cumulative <= (1 - p.top_p)
        drop_sorted[-1] = False  # always keep the most likely token
        logits = logits.masked_fill(drop_sorted.scatter(0, order, drop_sorted), float("-inf"))
    probs = logits.softmax(-1)
    return int(torch.multinomial(probs, 1, generator=gen).item())
