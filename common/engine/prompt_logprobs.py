"""Prompt logprobs (completions ``echo`` + ``logprobs``, vLLM's ``prompt_logprobs``).

The logprob of each prompt token given the ones before it comes from the prefill forward
itself: the runner takes the final hidden state of every scored position through the LM
head (not only the sampled last one), and ``score_rows`` turns each row into the
log-softmax (fp32, raw logits: before any sampling setting) of the next prompt token plus
the ``top`` most likely alternatives. Under PCP every rank scores the positions of its own
zigzag pieces; the coordinator merges them by position (services/ranks/group.py).
A request that asks for them computes its whole prompt: the prefix cache would skip the
positions whose scores are wanted (common/engine/scheduler.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

from pdserve.common.engine.sampling_params import TokenLogprobs


class ScoreRow(NamedTuple):
    request_id: str
    position: int  # the position whose hidden state predicts prompt[position + 1]
    row: int  # its row in the step's flattened tokens
    next_token: int  # prompt[position + 1]
    top: int  # alternatives wanted


if TYPE_CHECKING:
    import torch


# request id -> (position, logprobs of prompt[position + 1])
PromptScores = dict[str, list[tuple[int, TokenLogprobs]]]


def rows_of_piece(
    request_id: str,
    next_ids: list[int],
    top: int,
    first: int,
    stop: int,
    start_position: int,
    base_row: int,
) -> list[ScoreRow]:
    """The scored rows among a sequence's step tokens ``first:stop`` (indices into its
    ``token_ids``), which sit at rows ``base_row ..`` of the step."""
    return [
        ScoreRow(request_id, start_position + k, base_row + k - first, next_ids[k], top)
        for k in range(first, min(stop, len(next_ids)))
    ]


def score_rows(logits: torch.Tensor, rows: list[ScoreRow]) -> PromptScores:
    """``logits`` [R, V]: one row per ``rows`` entry, in order."""
    import torch

    out: PromptScores = {}
    if not rows:
        return out
    logprobs = torch.log_softmax(logits.float(), dim=-1)  # [R, V]
    nxt = torch.tensor([r.next_token for r in rows], device=logits.device)
    chosen = logprobs.gather(1, nxt[:, None])[:, 0].tolist()  # [R]
    most = max(r.top for r in rows)
    top_ids: list[list[int]] = [[] for _ in rows]
    top_values: list[list[float]] = [[] for _ in rows]
    if most:
        top = logprobs.topk(most, dim=-1)  # [R, most]
        top_ids, top_values = top.indices.tolist(), top.values.tolist()
    for j, r in enumerate(rows):
        lp = TokenLogprobs(
            token_id=r.next_token,
            logprob=chosen[j],
            top_ids=top_ids[j][: r.top],
            top_logprobs=top_values[j][: r.top],
        )
        out.setdefault(r.request_id, []).append((r.position, lp))
    return out


def in_order(num_prompt_tokens: int, scores: dict[int, TokenLogprobs]) -> list[TokenLogprobs]:
    """Entry i: the logprobs of prompt token i + 1 (the first token has none)."""
    missing = [p for p in range(num_prompt_tokens - 1) if p not in scores]
    if missing:
        raise RuntimeError(f"prompt logprobs missing for positions {missing[:5]}...")
    return [scores[p] for p in range(num_prompt_tokens - 1)]
