"""The target's hidden states a drafter reads (methods ``mtp`` and ``dspark``).

With ``CausalLM.keep_hidden`` the target's forward leaves the hidden states of its logits
rows in ``CausalLM.hidden`` (the final ones before the final norm, or with
``hidden_layers`` the chosen layers' outputs side by side: common/model/decoder.py); after
a verify, :meth:`TargetHidden.keep` holds those of the accepted positions, exactly what
the next proposal needs. Where they are not at hand (a request's first proposal: the
prompt, on the decode side of a disaggregated deployment too; after a step without drafts,
a preemption or a prefix-cache hit) :meth:`TargetHidden.of` runs the target over the
missing positions again, reading the target's KV cache and writing nothing (slots -1), in
forwards of at most ``max_num_batched_tokens`` tokens. The target's own KV and the tokens
it verifies are untouched, so output is unchanged by construction.
"""

from __future__ import annotations

import dataclasses

import torch

from pdserve.common.engine.model_runner import ModelRunner
from pdserve.common.engine.request import Request
from pdserve.common.engine.step_plan import ScheduledSeq, StepPlan


class TargetHidden:
    def __init__(self, runner: ModelRunner, chunk: int) -> None:
        self.runner = runner
        self.chunk = chunk  # the longest forward of a catch-up (max_num_batched_tokens)
        # request id -> (first position, the target's hidden states from there) [n, F]
        self._pending: dict[str, tuple[int, torch.Tensor]] = {}

    def keep(self, kept: list[tuple[str, int, int, int]]) -> None:
        """After the target's step: per request (id, logits row, position of that row, rows
        to keep), the target's hidden states of those rows. Requests not named lose theirs."""
        hidden = self.runner.model.hidden
        self._pending = {}
        if hidden is None:
            return
        for request_id, row, position, num in kept:
            # a copy: a CUDA graph's output is overwritten by its next replay
            self._pending[request_id] = (position, hidden[row : row + num].clone())

    def holds(self, request_id: str, a: int, b: int) -> bool:
        """Whether the kept rows of ``request_id`` cover positions [a, b)."""
        held = self._pending.get(request_id)
        return a == b or (held is not None and held[0] <= a and b <= held[0] + held[1].shape[0])

    @torch.inference_mode()
    def of(self, reqs: list[Request], spans: list[tuple[int, int]]) -> list[torch.Tensor]:
        """Per request the target's hidden states of positions [a, b) [b - a, F]: kept from
        the last step where they cover the span, else recomputed from the target's KV."""
        out: list[torch.Tensor | None] = [None] * len(reqs)
        redo: list[int] = []
        for i, (req, (a, b)) in enumerate(zip(reqs, spans, strict=True)):
            held = self._pending.get(req.request_id)
            if held is not None and held[0] <= a and b <= held[0] + held[1].shape[0]:
                out[i] = held[1][a - held[0] : b - held[0]]
            elif a == b:
                out[i] = torch.empty(
                    0, self.width, dtype=self.runner.dtype, device=self.runner.device
                )
            else:
                redo.append(i)
        # pieces of at most max_num_batched_tokens, as many to a forward as that many hold
        seqs = [
            ScheduledSeq(reqs[i].request_id, reqs[i].token_ids_between(x, y), x,
                         reqs[i].block_ids, False)
            for i in redo
            for x, y in self.chunks(*spans[i])
        ]  # fmt: skip
        owner = [i for i in redo for _ in self.chunks(*spans[i])]
        got: list[torch.Tensor | None] = [None] * len(seqs)
        runner = self.runner
        for group in self.forwards(seqs):
            ids, positions, meta, _ = runner.prepare(StepPlan([seqs[n] for n in group]))
            # read the target's KV, write none of it (a negative slot writes nothing)
            meta = dataclasses.replace(meta, slot_mapping=torch.full_like(meta.slot_mapping, -1))
            hidden = runner.model.hidden_states(ids, positions, runner.kv_cache, meta)
            for n, piece in zip(group, hidden.split([len(seqs[n].token_ids) for n in group]),
                                strict=True):  # fmt: skip
                got[n] = piece
        for i in redo:
            out[i] = torch.cat(
                [g for g, o in zip(got, owner, strict=True) if o == i and g is not None]
            )
        return [h for h in out if h is not None]

    @property
    def width(self) -> int:
        """Features of one position: hidden_size times the layers kept (1 without)."""
        layers = self.runner.model.hidden_layers
        return self.runner.cfg.hidden_size * (1 if layers is None else len(layers))

    def chunks(self, a: int, b: int) -> list[tuple[int, int]]:
        """[a, b) in pieces of at most max_num_batched_tokens positions."""
        n = self.chunk
        return [(x, min(x + n, b)) for x in range(a, b, n)]

    def forwards(self, seqs: list[ScheduledSeq]) -> list[list[int]]:
        """``seqs`` (in order) grouped into forwards of at most max_num_batched_tokens tokens,
        each group's one-token seqs first (the runner's order: decodes, then the rest)."""
        groups: list[list[int]] = []
        total = 0
        for n, seq in enumerate(seqs):
            if not groups or total + len(seq.token_ids) > self.chunk:
                groups.append([])
                total = 0
            groups[-1].append(n)
            total += len(seq.token_ids)
        return [sorted(g, key=lambda n: len(seqs[n].token_ids) != 1) for g in groups]
