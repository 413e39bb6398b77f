"""The sampler (pure torch): logits to tokens, each row with its own parameters."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pdserve.common.engine.sampling_params import SamplingParams, TokenLogprobs
from pdserve.common.engine.structured import GrammarTable

FAILED_TOKEN = -1  # a row the sampler could not sample (Sampler.failed_rows says why)

__all__ = [
    "FAILED_TOKEN",
    "Sampler",
    "SamplingParams",
    "TokenLogprobs",
    "adjust_logits",
    "batch_probs",
    "draw_batch",
    "exponential_race",
    "is_batched",
    "on_device",
    "row_probs",
    "sample_row",
    "token_generator",
    "token_logprobs",
]


class Sampler:
    """logits [S, V] -> one token id per row, each row with its own parameters.

    A seeded request draws its n-th token from a generator seeded by (seed, n), so the
    draw does not depend on which process samples it: prefill samples the first token,
    decode the rest, and the tokens equal the monolithic engine's. Penalties, logit_bias
    and min_tokens read the row's prompt and output tokens, which both services hold, so
    they too act the same on the first token (prefill) and on the rest (decode).
    """

    def __init__(
        self, eos_token_ids: frozenset[int] = frozenset(), grammars: GrammarTable | None = None
    ) -> None:
        """``grammars``: the structured-output matchers; None: such requests are refused."""
        self.eos_token_ids = eos_token_ids
        self.grammars = grammars
        # Rows of the last call that could not be sampled (row -> why); their token is
        # FAILED_TOKEN. One request's numerical failure is its own, never its batch's.
        self.failed_rows: dict[int, str] = {}

    def __call__(
        self,
        logits: torch.Tensor,  # [S, V]
        params: list[SamplingParams],
        num_generated: list[int],
        histories: Sequence[tuple[Sequence[int], Sequence[int]]] | None = None,
        request_ids: Sequence[str] | None = None,
    ) -> list[int]:
        """``histories``: per row, (prompt token ids, output token ids so far); needed
        only by rows whose params adjust logits (penalties, logit_bias, min_tokens,
        structured output, which also needs ``request_ids``)."""
        greedy = logits.argmax(dim=-1)
        tokens = greedy.tolist()
        # argmax picks a NaN where a row has one: one check (one sync) for every plain
        # greedy row, which then needs no per-row tensor op at all
        nan = torch.isnan(logits.gather(-1, greedy[:, None])).squeeze(-1).tolist()
        self.failed_rows = {}
        # Unseeded rows that only scale and truncate: one draw for all of them (a step of
        # such rows made per row cost a few launches and host syncs each on CUDA)
        batched = [row for row, p in enumerate(params) if is_batched(p)]
        if batched:
            index = torch.tensor(batched, dtype=torch.long, device=logits.device)
            drawn, ok = draw_batch(logits[index], [params[row] for row in batched])
            for row, token, good in zip(batched, *torch.stack((drawn, ok.long())).tolist(),
                                        strict=True):  # fmt: skip
                tokens[row] = token if good else FAILED_TOKEN
                if not good:
                    self.failed_rows[row] = not_finite(params[row])
        done = set(batched)
        for row, (p, n) in enumerate(zip(params, num_generated, strict=True)):
            if row in done:
                continue
            if p.is_greedy and not p.adjusts_logits:
                if nan[row]:
                    self.failed_rows[row] = "the model's logits for this request are NaN"
                    tokens[row] = FAILED_TOKEN
                continue
            try:
                tokens[row] = self._row(logits, row, p, n, tokens[row], histories, request_ids)
            except (RuntimeError, ValueError) as exc:  # NaN / inf / empty distribution
                self.failed_rows[row] = str(exc).splitlines()[0] if str(exc) else repr(exc)
                tokens[row] = FAILED_TOKEN
        return tokens

    def _row(
        self,
        logits: torch.Tensor,  # [S, V]
        row: int,
        p: SamplingParams,
        n: int,
        greedy_token: int,
        histories: Sequence[tuple[Sequence[int], Sequence[int]]] | None,
        request_ids: Sequence[str] | None,
    ) -> int:
        row_logits = logits[row]
        token = greedy_token
        if p.adjusts_logits:
            prompt, output = histories[row] if histories is not None else ((), ())
            row_logits = adjust_logits(row_logits, p, prompt, output, self.eos_token_ids)
            if p.structured is not None:
                self._grammar_mask(row_logits, p, output, request_ids, row)
            if p.is_greedy:
                token = int(row_logits.argmax())
        if not p.is_greedy:
            token = sample_row(row_logits, p, token_generator(p.seed, n, logits.device))
        elif bool(torch.isnan(row_logits[token])):
            raise ValueError("the model's logits for this request are NaN")
        if p.structured is not None and self.grammars is not None and request_ids:
            output = histories[row][1] if histories is not None else ()
            self.grammars.accept(request_ids[row], token, p.structured, output)
        return token

    def _grammar_mask(
        self,
        row_logits: torch.Tensor,  # [V]
        p: SamplingParams,
        output: Sequence[int],
        request_ids: Sequence[str] | None,
        row: int,
    ) -> None:
        assert p.structured is not None
        if self.grammars is None or request_ids is None:
            raise RuntimeError("a structured-output request reached a sampler without grammars")
        self.grammars.mask(row_logits, request_ids[row], p.structured, output)


def token_logprobs(
    logits: torch.Tensor,  # [S, V]
    params: list[SamplingParams],
    tokens: list[int],
) -> list[TokenLogprobs | None]:
    """Per row, the sampled token's logprob and its ``p.logprobs`` best alternatives, from
    the log-softmax of the raw logits in fp32 (None for rows that asked for none)."""
    rows = [i for i, p in enumerate(params) if p.logprobs is not None]
    out: list[TokenLogprobs | None] = [None] * len(params)
    if not rows:
        return out
    index = torch.tensor(rows, device=logits.device)
    logprobs = torch.log_softmax(logits[index].float(), dim=-1)  # [R, V]
    chosen = logprobs.gather(1, torch.tensor([[tokens[i]] for i in rows], device=logits.device))
    most = max(params[i].logprobs or 0 for i in rows)
    top = logprobs.topk(most, dim=-1) if most else None  # [R, most]
    for j, i in enumerate(rows):
        k = params[i].logprobs or 0
        out[i] = TokenLogprobs(
            token_id=tokens[i],
            logprob=float(chosen[j, 0]),
            top_ids=top.indices[j, :k].tolist() if top is not None else [],
            top_logprobs=top.values[j, :k].tolist() if top is not None else [],
        )
    return out


def token_generator(seed: int | None, index: int, device: torch.device) -> torch.Generator:
    gen = torch.Generator(device=device)
    if seed is None:
        gen.seed()
    else:
        gen.manual_seed((seed * 1_000_003 + index) % 2**63)
    return gen


def adjust_logits(
    logits: torch.Tensor,  # [V]
    p: SamplingParams,
    prompt: Sequence[int],
    output: Sequence[int],
    eos_token_ids: frozenset[int],
) -> torch.Tensor:
    """vLLM's order: min_tokens and logit_bias, then repetition, frequency and presence
    penalties. Returns a new fp32 row."""
    logits = logits.float().clone()  # [V]
    vocab = logits.shape[-1]
    device = logits.device
    if len(output) < p.min_tokens:
        stops = set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_token_ids))
        banned = [t for t in stops if 0 <= t < vocab]
        if banned:
            logits[torch.tensor(banned, device=device)] = float("-inf")
    if p.logit_bias:
        ids = [t for t in p.logit_bias if 0 <= t < vocab]  # validated upstream; never index out
        biases = torch.tensor([p.logit_bias[t] for t in ids], device=device)
        logits[torch.tensor(ids, dtype=torch.long, device=device)] += biases
    if p.repetition_penalty != 1.0 and (prompt or output):
        seen = torch.tensor(sorted(set(prompt) | set(output)), dtype=torch.long, device=device)
        picked = logits[seen]
        logits[seen] = torch.where(
            picked > 0, picked / p.repetition_penalty, picked * p.repetition_penalty
        )
    if (p.frequency_penalty or p.presence_penalty) and output:
        counts = torch.bincount(torch.tensor(list(output), device=device), minlength=vocab)[:vocab]
        logits -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0)
    return logits


def sample_row(logits: torch.Tensor, p: SamplingParams, gen: torch.Generator) -> int:
    probs = row_probs(logits, p)
    return int(torch.multinomial(probs, 1, generator=gen).item())


def row_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The distribution [V] (fp32) a sampled row draws from: temperature, top-k, top-p,
    min-p applied to ``logits`` (already adjusted). Speculative decoding verifies against it."""
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
    if p.min_p > 0.0:  # after temperature, as vLLM does
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < p.min_p * probs.max(), float("-inf"))
    probs = logits.softmax(-1)
    if not bool(torch.isfinite(probs).all()) or not float(probs.sum()) > 0.0:
        raise ValueError(not_finite(p))
    return probs


def not_finite(p: SamplingParams) -> str:
    return (
        f"the sampling distribution is not finite (temperature {p.temperature:g}, "
        f"top_p {p.top_p:g}, top_k {p.top_k}, min_p {p.min_p:g})"
    )


def is_batched(p: SamplingParams) -> bool:
    """A sampled row drawn with the others of its step (``draw_batch``): no seed (a seeded
    row draws from its own generator, sample_row) and nothing but temperature, top-k,
    top-p, min-p."""
    return not p.is_greedy and p.seed is None and not p.adjusts_logits


def batch_probs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """``row_probs`` of every row of ``logits`` [R, V] at once (row i with ``params[i]``),
    without its check: a row that is not a distribution has NaN or sums to 0."""
    device, vocab = logits.device, logits.shape[-1]

    def column(values: list[float]) -> torch.Tensor:
        return on_device(torch.tensor(values, dtype=torch.float32), device)[:, None]

    logits = logits.float() / column([p.temperature for p in params])  # [R, V]
    ks = [p.top_k if 0 < p.top_k < vocab else 0 for p in params]
    if any(ks):
        top = torch.topk(logits, max(ks), dim=-1).values  # [R, k_max], descending
        index = on_device(torch.tensor([max(k, 1) - 1 for k in ks], dtype=torch.long), device)
        kth = top.gather(1, index[:, None])
        kth = torch.where(column([float(k > 0) for k in ks]) > 0, kth, float("-inf"))
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if any(p.top_p < 1.0 for p in params):
        sorted_logits, order = torch.sort(logits, dim=-1, descending=False)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        # a row without top-p drops nothing (-1: below every cumulative probability)
        drop_sorted = cumulative <= column([1 - p.top_p if p.top_p < 1.0 else -1.0
                                            for p in params])  # fmt: skip
        drop_sorted[:, -1] = False  # always keep the most likely token
        logits = logits.masked_fill(drop_sorted.scatter(1, order, drop_sorted), float("-inf"))
    if any(p.min_p > 0.0 for p in params):
        probs = logits.softmax(-1)
        floor = column([p.min_p for p in params]) * probs.max(dim=-1, keepdim=True).values
        logits = logits.masked_fill(probs < floor, float("-inf"))
    return logits.softmax(-1)


def on_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A small host tensor on ``device``; on CUDA through pinned memory, so that the copy
    does not wait for the step in flight (common/engine/async_steps.py launches draws)."""
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)


def exponential_race(probs: torch.Tensor) -> torch.Tensor:
    """One token per row of ``probs`` [R, V]: torch.multinomial's own algorithm for one
    draw (argmax of p / q, q ~ Exp(1); CUDA's exponential never gives 0), without its
    argument checks, which read the device twice: a launched step would wait there for
    the one in flight (async_steps.py)."""
    q = torch.empty_like(probs).exponential_()
    return (probs / q).argmax(dim=-1)


def draw_batch(
    logits: torch.Tensor, params: Sequence[SamplingParams]
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row of ``logits`` [R, V] from ``batch_probs`` (torch's default
    generator, as an unseeded row's fresh one would be), and whether the row's
    distribution was finite (else its token is meaningless); both [R] on the device, no
    host sync on CUDA."""
    probs = batch_probs(logits, params)
    ok = torch.isfinite(probs).all(dim=-1) & (probs.sum(dim=-1) > 0)
    # a row that is no distribution draws from a uniform one instead (flagged, dropped)
    probs = torch.where(ok[:, None], probs, torch.ones_like(probs))
    if probs.device.type != "cpu":
        return exponential_race(probs), ok
    # On CPU torch.multinomial costs ~1 ms a row of a 49k vocabulary (one exponential a
    # token); the inverse of the distribution function in float64, one uniform a row,
    # draws from the same distribution ~3x faster. right=True never lands on a token of
    # probability 0 (its cumulative equals the one before it).
    cumulative = probs.double().cumsum(dim=-1)  # [R, V]
    u = torch.rand((probs.shape[0], 1), dtype=torch.float64) * cumulative[:, -1:]
    drawn = torch.searchsorted(cumulative, u, right=True).clamp_(max=probs.shape[-1] - 1)
    # u rounded up to the total (the last cumulative): the most likely token instead
    drawn = torch.where(probs.gather(1, drawn) > 0, drawn, probs.argmax(-1, keepdim=True))
    return drawn.squeeze(-1), ok
