"""Draft-model proposer: a smaller model with the target's tokenizer, its own paged KV cache.

The draft cache has the target's block count and block size and is indexed by the target's
block tables, so it needs no allocator of its own: every position the draft writes lies in
a block the target holds for the step (the k drafted positions are allocated before the
proposal). The draft computes its own prompt KV the first time a request drafts (in the
disaggregated path the prompt KV pulled from prefill is the target's only), and after a
verify keeps only what the target accepted (``Request.num_draft_computed``).
"""

from __future__ import annotations

import msgspec
import torch

from pdserve.common.engine.config import EngineConfig
from pdserve.common.engine.model_runner import ModelRunner
from pdserve.common.engine.request import Request
from pdserve.common.engine.sampling import row_probs, token_generator
from pdserve.common.engine.spec_decode.proposal import Draft
from pdserve.common.engine.step_plan import ScheduledSeq, StepPlan
from pdserve.common.errors import ModelLoadError
from pdserve.common.model.checkpoint.config import ModelConfig
from pdserve.common.model.checkpoint.files import resolve_model
from pdserve.common.model.checkpoint.tokenizer import Tokenizer

DRAFT_STREAM = 1 << 40  # seeded draws of the draft: a stream apart from the target's


class DraftModelProposer:
    def __init__(
        self,
        model: str,
        config: EngineConfig,
        target: ModelConfig,
        target_tokenizer: Tokenizer,
        num_blocks: int,
    ) -> None:
        if any(w is not None for w in target.layer_windows):
            # The target's table drops blocks behind its window; the draft's own prompt
            # KV would need them.
            raise ModelLoadError(
                "speculative_config: method 'draft_model' does not run with a sliding-window "
                "target yet; use 'ngram'"
            )
        model_dir = resolve_model(model)
        cfg = ModelConfig.from_dir(model_dir)
        if cfg.vocab_size != target.vocab_size:
            raise ModelLoadError(
                f"speculative_config: the draft model {model} has a vocabulary of "
                f"{cfg.vocab_size} tokens, the target {target.vocab_size}; a draft model must "
                "share the target's tokenizer"
            )
        vocab = Tokenizer.from_dir(model_dir).vocab
        if vocab != target_tokenizer.vocab:
            raise ModelLoadError(
                f"speculative_config: the draft model {model} has another tokenizer than the "
                "target (their vocabularies differ); a draft model must share the target's"
            )
        draft_config = msgspec.structs.replace(
            config, model=str(model_dir), num_kv_blocks=num_blocks, speculative_config=None
        )
        self.runner = ModelRunner.from_config(cfg, model_dir, draft_config)

    def propose(self, reqs: list[Request], seqs: list[ScheduledSeq]) -> list[Draft]:
        """``seqs``: the target's verify seqs of ``reqs`` (blocks allocated for the drafts)."""
        nums = [s.num_drafts for s in seqs]
        tokens: list[list[int]] = [[] for _ in reqs]
        probs: list[list[torch.Tensor]] = [[] for _ in reqs]
        gens = [
            None if r.sampling.is_greedy else
            token_generator(r.sampling.seed, DRAFT_STREAM + len(r.output_token_ids),
                            self.runner.device)
            for r in reqs
        ]  # fmt: skip
        # Step 0 catches up from what the draft holds to the last sampled token (the whole
        # prompt the first time); each later step feeds the draft its previous draft.
        active = list(range(len(reqs)))
        for j in range(max(nums)):
            plan_seqs = []
            for i in active:
                req, seq = reqs[i], seqs[i]
                end = seq.start_position + 1 + j  # positions < end are fed by this step
                start = req.num_draft_computed if j == 0 else end - 1
                ids = req.token_ids_between(start, end) if j == 0 else [tokens[i][-1]]
                plan_seqs.append(ScheduledSeq(req.request_id, ids, start, seq.block_ids, True))
            order = sorted(range(len(active)), key=lambda n: len(plan_seqs[n].token_ids) != 1)
            logits = self.runner.execute(StepPlan([plan_seqs[n] for n in order]))  # [A, V]
            for row, n in enumerate(order):
                i = active[n]
                p, gen = reqs[i].sampling, gens[i]
                if gen is None:
                    tokens[i].append(int(logits[row].argmax()))
                else:
                    q = row_probs(logits[row], p)  # [V]
                    tokens[i].append(int(torch.multinomial(q, 1, generator=gen).item()))
                    probs[i].append(q)
                reqs[i].num_draft_computed = plan_seqs[n].context_len
            active = [i for i in active if nums[i] > j + 1]
        return [Draft(t, torch.stack(q) if q else None) for t, q in zip(tokens, probs, strict=True)]
