"""MTP proposer: DeepSeek's multi-token-prediction layer drafts from the target's own hidden
states (common/model/draft/mtp_layer.py for the layer's arithmetic).

The layer's entry at position i is made of ``h_i`` (the target's final hidden state before
its final norm) and the token ``t_{i+1}``; it guesses ``t_{i+2}``. A verify step feeding
the last token ``t_s`` at position s therefore drafts its first token from the layer at
position s - 1, and each further draft j from position s - 1 + j with the draft ``d_j`` and
the layer's own previous output in place of the target's hidden state (the one layer reused
autoregressively, as vLLM does with one MTP layer and k > 1).

KV: the layer has its own paged cache of one layer, with the target's block count and
indexed by the target's block tables (as the draft model's, common/engine/spec_decode/
draft_model.py). ``Request.num_draft_computed`` is how far it holds correct entries: after a
proposal, up to s (the draft positions beyond hold entries made from the layer's own hidden
states; the next proposal overwrites them).

The target's hidden states: the engine's target forward leaves those of its logits rows in
``CausalLM.hidden``; after a verify, :meth:`keep` holds the ones of the accepted
positions, exactly what the next proposal needs. Where they are not at hand (a request's
first proposal: the prompt; after a step without drafts or a preemption) the proposer runs
the target over the missing positions again, reading the target's KV cache and writing
nothing (slots -1), and takes every position's hidden state (forwards of at most
``max_num_batched_tokens`` tokens, then the MTP layer over them likewise). On the decode side of a
disaggregated deployment this is how the MTP layer gets its prompt KV: the prompt's hidden
states never leave prefill, decode recomputes them once from the pulled KV. It costs one
target prefill over the prompt on the decode side per request (drafts only: the target's
own KV and the output are untouched).
"""

from __future__ import annotations

import msgspec
import torch

from pdserve.common.engine.config import EngineConfig
from pdserve.common.engine.kv_cache import new_cache
from pdserve.common.engine.model_runner import ModelRunner
from pdserve.common.engine.request import Request
from pdserve.common.engine.sampling import row_probs, token_generator
from pdserve.common.engine.spec_decode.draft_model import DRAFT_STREAM
from pdserve.common.engine.spec_decode.proposal import Draft
from pdserve.common.engine.spec_decode.target_hidden import TargetHidden
from pdserve.common.engine.step_plan import ScheduledSeq, StepPlan
from pdserve.common.errors import ModelLoadError
from pdserve.common.model.checkpoint.config import ModelConfig
from pdserve.common.model.draft.mtp_layer import MTPLayer, load_mtp_layer


class MTPProposer:
    def __init__(self, config: EngineConfig, target: ModelConfig, runner: object) -> None:
        if target.num_nextn_predict_layers < 1:
            raise ModelLoadError(
                f"speculative method 'mtp': the model {config.model} has no multi-token-"
                "prediction layer (config.json: num_nextn_predict_layers is 0 or absent); "
                "use 'ngram' or 'draft_model'"
            )
        if not isinstance(runner, ModelRunner) or runner.parallel.is_parallel:
            raise ModelLoadError(
                "speculative method 'mtp' needs the target model in the engine's own process "
                "(decode tensor parallel 1); it reads the target's hidden states"
            )
        self.runner = runner
        self.hidden = TargetHidden(runner, config.max_num_batched_tokens)
        runner.model.keep_hidden = True
        if runner.graphs is not None:  # captured without the hidden states: again with them
            runner.recapture_graphs()
        self.layer: MTPLayer = load_mtp_layer(
            target, runner.model_dir, runner.model, runner.dtype, runner.device
        )
        self.kv_cache = self._new_cache()

    def _new_cache(self) -> torch.Tensor:  # [N, 1, ...]: the target's layout, one layer
        layout = msgspec.structs.replace(self.runner.layout, num_layers=1)
        return new_cache(layout, self.runner.device)

    def keep(self, kept: list[tuple[str, int, int, int]], plan: StepPlan) -> None:
        """After the target's step: the hidden states of the rows named (TargetHidden.keep)."""
        self.hidden.keep(kept)

    # -- proposing --------------------------------------------------------------------------

    @torch.inference_mode()
    def propose(self, reqs: list[Request], seqs: list[ScheduledSeq]) -> list[Draft]:
        """``seqs``: the target's verify seqs of ``reqs`` (blocks allocated for the drafts)."""
        if self.kv_cache.shape[0] != self.runner.layout.num_blocks:  # the target's resized
            self.kv_cache = self._new_cache()
        nums = [s.num_drafts for s in seqs]
        ends = [s.start_position for s in seqs]  # s: the position of the last real token
        starts = [min(r.num_draft_computed, s) for r, s in zip(reqs, ends, strict=True)]
        hidden = self.hidden.of(reqs, list(zip(starts, ends, strict=True)))
        self._lead_in(reqs, starts, ends, hidden)  # starts, hidden: now of step 0's last piece
        tokens: list[list[int]] = [[] for _ in reqs]
        probs: list[list[torch.Tensor]] = [[] for _ in reqs]
        gens = [
            None if r.sampling.is_greedy else
            token_generator(r.sampling.seed, DRAFT_STREAM + len(r.output_token_ids),
                            self.runner.device)
            for r in reqs
        ]  # fmt: skip
        # Step 0: positions [a, s) with t_{i+1} and the target's h_i; step j: position
        # s - 1 + j with d_j and the layer's own last output.
        active = list(range(len(reqs)))
        for j in range(max(nums)):
            plan_seqs = []
            for i in active:
                req, seq = reqs[i], seqs[i]
                if j == 0:
                    ids = req.token_ids_between(starts[i] + 1, ends[i] + 1)
                    plan_seqs.append(ScheduledSeq(req.request_id, ids, starts[i],
                                                  seq.block_ids, True))  # fmt: skip
                else:
                    plan_seqs.append(ScheduledSeq(req.request_id, [tokens[i][-1]],
                                                  ends[i] - 1 + j, seq.block_ids, True))  # fmt: skip
            order = sorted(range(len(active)), key=lambda n: len(plan_seqs[n].token_ids) != 1)
            last = self._run([plan_seqs[n] for n in order], [hidden[active[n]] for n in order])
            logits = self.layer.logits(last)  # [A, V]
            for row, n in enumerate(order):
                i = active[n]
                hidden[i] = last[row : row + 1]
                p, gen = reqs[i].sampling, gens[i]
                if gen is None:
                    tokens[i].append(int(logits[row].argmax()))
                else:
                    q = row_probs(logits[row], p)  # [V]
                    tokens[i].append(int(torch.multinomial(q, 1, generator=gen).item()))
                    probs[i].append(q)
            active = [i for i in active if nums[i] > j + 1]
        for req, end in zip(reqs, ends, strict=True):
            req.num_draft_computed = end  # entries from s on were made of drafts
        return [Draft(t, torch.stack(q) if q else None) for t, q in zip(tokens, probs, strict=True)]

    def _lead_in(
        self, reqs: list[Request], starts: list[int], ends: list[int], hidden: list[torch.Tensor]
    ) -> None:
        """The MTP layer's KV of positions [a, s) longer than max_num_batched_tokens (the
        prompt), but for its last piece, in forwards of at most that many tokens; ``starts``
        and ``hidden`` are left holding that last piece's."""
        seqs: list[ScheduledSeq] = []
        fed: list[torch.Tensor] = []
        for i, req in enumerate(reqs):
            a, pieces = starts[i], self.hidden.chunks(starts[i], ends[i])
            for x, y in pieces[:-1]:
                ids = req.token_ids_between(x + 1, y + 1)
                seqs.append(ScheduledSeq(req.request_id, ids, x, req.block_ids, True))
                fed.append(hidden[i][x - a : y - a])
            if len(pieces) > 1:
                starts[i] = pieces[-1][0]
                hidden[i] = hidden[i][starts[i] - a :]
        for group in self.hidden.forwards(seqs):
            self.run_layer([seqs[n] for n in group], [fed[n] for n in group])

    def _run(self, seqs: list[ScheduledSeq], hidden: list[torch.Tensor]) -> torch.Tensor:
        """The MTP layer's output at each seq's last position [S, hidden]."""
        return self.run_layer(seqs, hidden)[_last_rows(seqs)]

    @torch.inference_mode()
    def run_layer(self, seqs: list[ScheduledSeq], hidden: list[torch.Tensor]) -> torch.Tensor:
        """The MTP layer over ``seqs`` (decodes first; token i of a seq is t_{p+1} of its
        position p) fed ``hidden`` (one [n, hidden] a seq: h_p); h'_p of every token."""
        runner = self.runner
        ids, positions, meta, _ = runner.prepare(StepPlan(seqs))
        cos, sin = runner.model.model.rotary.cos_sin(positions)
        h = torch.cat(hidden)
        rope = (cos.to(h.dtype), sin.to(h.dtype))
        return self.layer.predict(ids, positions, h, rope, self.kv_cache[:, 0], meta)  # [T, hidden]


def _last_rows(seqs: list[ScheduledSeq]) -> list[int]:
    ends, total = [], 0
    for s in seqs:
        total += len(s.token_ids)
        ends.append(total - 1)
    return ends
