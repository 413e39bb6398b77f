"""Asynchronous scheduling: step N+1 is scheduled and launched before step N's tokens
reach the host, so the host's work of a step (scheduling, inputs, detokenising, stop
rules) runs while the device computes the previous one.

How a step overlaps (``EngineCore.step``):

1. Step N sampled greedily on the device (``launch_greedy``): its tokens stay there, a
   copy to the host is under way, and each sampled request got a ``PENDING_TOKEN`` as its
   newest output token.
2. The scheduler plans step N+1 as if that token were known: a decode of it is one token
   at the next position. The runner reads the real token from step N's device tensor
   (``Carry``), never from the plan.
3. Step N+1 is launched; only then does the host wait for step N's copy, put the tokens
   in place of the placeholders, and apply stop rules. A request that ended at step N
   was computed once more in step N+1 for nothing; that row is dropped.

Blocks freed while a step may still run (a finished, preempted or aborted request's, or
one that left a sliding window) are fenced by the pool (``BlockPool.fence``) and return
to it once that step is known done: a KV pull (a NIXL write the stream does not order)
must never land in a block a running step still reads or writes.

Only steps whose sampled rows are plain (greedy, or drawn without a seed with nothing but
temperature, top-k, top-p, min-p: OpenAI's default temperature 1 is such a row; no
logprobs, penalties, bias, grammar) overlap; any other step is sampled on the host as
before, after the previous one ends.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pdserve.common.engine.request import PENDING_TOKEN, Request
from pdserve.common.engine.sampling import draw_batch, is_batched, on_device
from pdserve.common.engine.sampling_params import SamplingParams

NAN_MESSAGE = "the model's logits for this request are NaN"


def is_plain(p: SamplingParams) -> bool:
    """A row the device samples alone, nothing read back but the token: greedy, or drawn
    with the step's other unseeded rows (sampling.is_batched)."""
    return (
        ((p.is_greedy and not p.adjusts_logits) or is_batched(p))
        and p.logprobs is None
        and p.prompt_logprobs is None
        and p.structured is None
    )


@dataclass(frozen=True)
class Carry:
    """Tokens of the step in flight that the next step's inputs take from the device."""

    tokens: torch.Tensor  # [S_prev] int64, on the device: the previous step's samples
    rows: list[tuple[int, int]]  # (sequence index in the plan, row of ``tokens``)

    def apply(self, input_ids: torch.Tensor, offsets: list[int]) -> None:
        """Write the carried tokens into ``input_ids`` [T]; ``offsets[i]``: the flat index
        of sequence i's first token (a carried sequence computes exactly that one)."""
        pairs = torch.tensor(
            [[offsets[seq] for seq, _ in self.rows], [row for _, row in self.rows]],
            dtype=torch.int64,
        )
        pairs = on_device(pairs, input_ids.device)
        input_ids.index_copy_(0, pairs[0], self.tokens.index_select(0, pairs[1]))


@dataclass
class InFlight:
    """A launched step whose sampled tokens the host has not read yet."""

    serial: int  # the pool's fence of the step (blocks freed while it may run)
    num_tokens: int
    tokens: torch.Tensor  # [S] int64 on the device: what the next step carries
    host: torch.Tensor  # [2, S] int64 on the host (pinned on CUDA): tokens, NaN flags
    event: torch.cuda.Event | None  # recorded after the copy to ``host``
    # per row: its request and the index of its placeholder in the output, None where the
    # request ended before the step was launched on (its row is ignored)
    rows: list[tuple[Request, int] | None] = field(default_factory=list)
    row_of: dict[int, int] = field(default_factory=dict)  # id(request) -> row

    def add(self, row: int, req: Request) -> None:
        req.output_token_ids.append(PENDING_TOKEN)
        self.rows[row] = (req, len(req.output_token_ids) - 1)
        self.row_of[id(req)] = row

    def wait(self) -> tuple[list[int], list[int]]:
        """The step's tokens and NaN flags, once its copy has landed."""
        if self.event is not None:
            self.event.synchronize()
        tokens, nan = self.host.tolist()
        return tokens, nan

    def carry(self, reqs: list[Request]) -> Carry | None:
        """What the next step (its requests ``reqs``, plan order) takes from this one."""
        rows = [
            (i, self.row_of[id(req)])
            for i, req in enumerate(reqs)
            if id(req) in self.row_of and req.has_pending_token
        ]
        return Carry(self.tokens, rows) if rows else None


def launch_greedy(
    logits: torch.Tensor, serial: int, num_tokens: int, params: list[SamplingParams] | None = None
) -> InFlight:
    """Every row's token of ``logits`` [S, V] on the device (argmax; the rows of ``params``
    that are not greedy drawn together, sampling.draw_batch), and its copy to the host
    started; the host path's failure check travels with it (argmax picks a NaN; a drawn
    row's distribution is not finite)."""
    greedy = logits.argmax(dim=-1)  # [S]
    nan = torch.isnan(logits.gather(-1, greedy[:, None])).squeeze(-1)
    drawn = [i for i, p in enumerate(params or []) if not p.is_greedy]
    if drawn:
        assert params is not None
        rows = on_device(torch.tensor(drawn, dtype=torch.int64), logits.device)
        tokens, ok = draw_batch(logits.index_select(0, rows), [params[i] for i in drawn])
        greedy = greedy.index_copy(0, rows, tokens)
        nan = nan.index_copy(0, rows, ~ok)
    both = torch.stack((greedy, nan.to(torch.int64)))  # [2, S]
    event = None
    if both.is_cuda:
        host = torch.empty(both.shape, dtype=torch.int64, pin_memory=True)
        host.copy_(both, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
    else:
        host = both
    return InFlight(serial, num_tokens, greedy, host, event, [None] * greedy.shape[0])
