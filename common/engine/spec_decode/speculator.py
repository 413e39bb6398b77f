"""The engine's side of speculative decoding: fill a step's draft slots, then decide per
sequence which drafts the target accepted (common/engine/spec_decode/rejection.py).

The scheduler reserves ``ScheduledSeq.num_drafts`` positions after a decoding sequence's
last token (blocks included); ``fill`` writes the proposer's tokens into them, the target
computes logits at all ``1 + num_drafts`` positions in one forward, and ``verify`` returns
per sequence the accepted drafts plus one token (the resampled one, or the bonus).
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec
import torch

from pdserve.common.engine.config import EngineConfig
from pdserve.common.engine.request import Request
from pdserve.common.engine.sampling import (
    Sampler,
    SamplingParams,
    TokenLogprobs,
    adjust_logits,
    row_probs,
    token_generator,
    token_logprobs,
)
from pdserve.common.engine.spec_decode.config import SpeculativeConfig
from pdserve.common.engine.spec_decode.draft_model import DraftModelProposer
from pdserve.common.engine.spec_decode.dspark import DSparkProposer
from pdserve.common.engine.spec_decode.dspark_v4 import DSparkV4Proposer
from pdserve.common.engine.spec_decode.mtp import MTPProposer
from pdserve.common.engine.spec_decode.ngram import ngram_propose
from pdserve.common.engine.spec_decode.proposal import Draft
from pdserve.common.engine.spec_decode.rejection import rejection_sample
from pdserve.common.engine.spec_decode.stats import SpecDecodeStats
from pdserve.common.engine.step_plan import StepPlan
from pdserve.common.model.checkpoint.config import ModelConfig
from pdserve.common.model.checkpoint.tokenizer import Tokenizer
from pdserve.common.model.family_api import family_for

# (request, tokens to append: accepted drafts + one, their logprobs or None, drafts rejected)
Verified = tuple[Request, list[int], list[TokenLogprobs | None], int]


class Speculator:
    def __init__(
        self,
        spec: SpeculativeConfig,
        config: EngineConfig,
        target: ModelConfig,
        tokenizer: Tokenizer,
        num_blocks: int,
        runner: object = None,
    ) -> None:
        """``runner``: the engine's target runner (method 'mtp' reads its hidden states)."""
        self.spec = spec
        self.k = spec.num_speculative_tokens
        self.stats = SpecDecodeStats(self.k)
        self.draft: DraftModelProposer | None = None
        if spec.method == "draft_model":
            assert spec.model is not None  # SpeculativeConfig checked it
            self.draft = DraftModelProposer(spec.model, config, target, tokenizer, num_blocks)
        # the proposers that read the target's hidden states (kept after each verify)
        self.mtp: MTPProposer | DSparkProposer | DSparkV4Proposer | None = None
        if spec.method == "mtp":
            self.mtp = MTPProposer(config, target, runner)
        elif spec.method == "dspark" and family_for(target).own_dspark:  # the checkpoint's
            self.mtp = DSparkV4Proposer(spec, config, target, runner, self.stats)
        elif spec.method == "dspark":
            self.mtp = DSparkProposer(spec, config, target, runner, self.stats)
        self._drafts: dict[str, Draft] = {}

    def fill(self, plan: StepPlan, reqs: list[Request]) -> StepPlan:
        """``plan`` with each sequence's reserved draft slots holding proposed tokens."""
        self._drafts = {}  # a step that failed between fill and verify leaves none behind
        picked = [i for i, s in enumerate(plan.seqs) if s.num_drafts]
        if not picked:
            return plan
        if self.draft is not None:
            drafts = self.draft.propose([reqs[i] for i in picked], [plan.seqs[i] for i in picked])
        elif self.mtp is not None:
            drafts = self.mtp.propose([reqs[i] for i in picked], [plan.seqs[i] for i in picked])
        else:
            spec = self.spec
            drafts = [
                Draft(ngram_propose(reqs[i].all_token_ids, plan.seqs[i].num_drafts,
                                    spec.lookup_min, spec.lookup_max))
                for i in picked
            ]  # fmt: skip
        seqs = list(plan.seqs)
        for i, draft in zip(picked, drafts, strict=True):
            seq = seqs[i]
            real = seq.token_ids[: len(seq.token_ids) - seq.num_drafts]
            # fewer drafts than slots (DSpark's confidence head, a deferred proposal): the
            # rest hold a filler the verify never reads; rolled back like rejected ones
            filler = (real + draft.token_ids)[-1:] * (seq.num_drafts - len(draft.token_ids))
            seqs[i] = msgspec.structs.replace(seq, token_ids=real + draft.token_ids + filler)
            self._drafts[seq.request_id] = draft
        return StepPlan(seqs)

    def verify(
        self,
        logits: torch.Tensor,  # [sum over sampled seqs of 1 + num_drafts, V]
        plan: StepPlan,
        reqs: list[Request],
        sampler: Sampler,
    ) -> list[Verified]:
        """Per sampled sequence, in plan order: the tokens to append and drafts rejected."""
        out: list[Verified] = []
        plain: list[tuple[int, Request]] = []  # (logits row, request): no drafts this step
        # MTP: (request id, logits row, its position, rows whose inputs the target accepted)
        kept: list[tuple[str, int, int, int]] = []
        row = 0
        for req, seq in zip(reqs, plan.seqs, strict=True):
            if not seq.sample:
                continue
            if seq.num_drafts == 0:
                plain.append((row, req))
                out.append((req, [], [], 0))
                kept.append((req.request_id, row, seq.context_len - 1, 1))
                row += 1
                continue
            draft = self._drafts.pop(req.request_id)
            rows = logits[row : row + 1 + len(draft.token_ids)]  # [d+1, V]: filler left out
            tokens = self._accept(rows, draft, req, sampler.eos_token_ids)
            num_accepted = len(tokens) - 1
            self.stats.add(len(draft.token_ids), num_accepted)
            kept.append((req.request_id, row, seq.start_position, 1 + num_accepted))
            lps = self._logprobs(rows, req.sampling, tokens)
            out.append((req, tokens, lps, seq.num_drafts - num_accepted))
            row += 1 + seq.num_drafts
        if self.mtp is not None:
            self.mtp.keep(kept, plan)
        if plain:
            index = torch.tensor([r for r, _ in plain], device=logits.device)
            sub = logits[index]  # [P, V]
            preqs = [r for _, r in plain]
            params = [r.sampling for r in preqs]
            tokens = sampler(
                sub, params, [len(r.output_token_ids) for r in preqs],
                [(r.prompt_token_ids, r.output_token_ids) for r in preqs],
                [r.request_id for r in preqs],
            )  # fmt: skip
            lps = token_logprobs(sub, params, tokens)
            by_req = {id(r): (t, lp) for r, t, lp in zip(preqs, tokens, lps, strict=True)}
            for n, (req, toks, _, _) in enumerate(out):
                if not toks:
                    token, lp = by_req[id(req)]
                    out[n] = (req, [token], [lp], 0)
        return out

    def _accept(
        self, rows: torch.Tensor, draft: Draft, req: Request, eos: frozenset[int]
    ) -> list[int]:
        """The accepted drafts and the token after them."""
        p, d = req.sampling, draft.token_ids
        if p.is_greedy and not p.adjusts_logits:
            best = rows.argmax(-1).tolist()
            n = 0
            while n < len(d) and d[n] == best[n]:
                n += 1
            return d[:n] + [best[n]]
        output = req.output_token_ids
        probs = []
        for i in range(len(d) + 1):
            row = rows[i]
            if p.adjusts_logits:  # penalties and min_tokens see the drafts before position i
                row = adjust_logits(row, p, req.prompt_token_ids, [*output, *d[:i]], eos)
            if p.is_greedy:
                probs.append(torch.nn.functional.one_hot(row.argmax(), row.shape[-1]).float())
            else:
                probs.append(row_probs(row, p))
        gen = token_generator(p.seed, len(output), rows.device)
        uniforms = torch.rand((1, len(d)), generator=gen, device=rows.device)
        num, nxt = rejection_sample(
            torch.stack(probs).unsqueeze(0),
            torch.tensor([d], dtype=torch.int64, device=rows.device),
            None if draft.probs is None else draft.probs.to(rows.device).unsqueeze(0),
            uniforms,
            gen,
        )
        n = int(num[0])
        return d[:n] + [int(nxt[0])]

    @staticmethod
    def _logprobs(
        rows: torch.Tensor, p: SamplingParams, tokens: Sequence[int]
    ) -> list[TokenLogprobs | None]:
        if p.logprobs is None:
            return [None] * len(tokens)
        return token_logprobs(rows[: len(tokens)], [p] * len(tokens), list(tokens))
