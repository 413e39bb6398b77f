"""Sampling parameters (wire-safe) and the sampler (pure torch)."""

from __future__ import annotations

import msgspec
import torch

from pdserve.common.errors import RequestError


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True):
    max_tokens: int = 16
    temperature: float = 0.0  # 0 means greedy
    top_k: int = 0  # 0 or -1: off
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self) -> None:
        if self.max_tokens < 1:
            raise RequestError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise RequestError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise RequestError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise RequestError(f"top_k must be -1, 0 (off) or positive, got {self.top_k}")
        if any(not s for s in self.stop):
            raise RequestError("stop strings must not be empty")


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
        for row, (p, n) in enumerate(zip(params, num_generated)):
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
