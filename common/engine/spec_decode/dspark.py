"""DSpark proposer: a DeepSpec draft (common/model/draft/dspark.py) drafts a block of tokens in one
forward from the target's hidden states of chosen layers, and its confidence head may
shorten what the target verifies.

State: the draft's keys and values of every context position, per draft layer, in a paged
cache with the target's block count and size, indexed by the target's block tables (as the
MTP layer's). A position's entries depend on the target's features there alone, so a
rejected draft needs no rollback (only accepted positions are ever written) and a block
shared through the prefix cache holds the same entries for every request that shares it.
``Request.num_draft_computed`` is how far they are written: after a proposal, up to the
position s of the last real token (exclusive).

Catching up: the features of the last verify's accepted rows are kept
(common/engine/spec_decode/target_hidden.py); any other missing positions -- a request's
first proposal (the prompt; on the decode side of a disaggregated deployment that is the
pulled prompt: prefill never runs the draft), after a preemption or a prefix-cache hit, a
step without drafts -- are rebuilt from the target's KV cache by running the target over
them again without writing its cache. At most ``max_num_batched_tokens`` positions are
rebuilt a step over all requests; a request whose state is not complete yet proposes
nothing that step (the verify then emits the target's one token) and is counted in
``SpecDecodeStats.num_deferred``. Its drafts come once the state is whole, never from a
partial one.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

import torch

from pdserve import kernels
from pdserve.common.engine.config import EngineConfig
from pdserve.common.engine.kv_cache import new_cache
from pdserve.common.engine.kv_layout import KVLayout
from pdserve.common.engine.model_runner import ModelRunner
from pdserve.common.engine.request import Request
from pdserve.common.engine.sampling import row_probs, token_generator
from pdserve.common.engine.spec_decode.config import SpeculativeConfig
from pdserve.common.engine.spec_decode.draft_model import DRAFT_STREAM
from pdserve.common.engine.spec_decode.proposal import Draft
from pdserve.common.engine.spec_decode.stats import SpecDecodeStats
from pdserve.common.engine.spec_decode.target_hidden import TargetHidden
from pdserve.common.engine.step_plan import ScheduledSeq, StepPlan
from pdserve.common.errors import ModelLoadError
from pdserve.common.model.checkpoint.config import ModelConfig
from pdserve.common.model.draft.dspark import DSparkDraft, load_dspark

KV = tuple[torch.Tensor, torch.Tensor]  # keys, values [n, H_kv, D]


class DSparkProposer:
    def __init__(
        self,
        spec: SpeculativeConfig,
        config: EngineConfig,
        target: ModelConfig,
        runner: object,
        stats: SpecDecodeStats,
    ) -> None:
        if not spec.model:
            raise ModelLoadError(
                "speculative method 'dspark' needs 'model' (a DeepSpec DSpark draft directory: "
                "config.json and safetensors) for this target; only a DeepSeek-V4 target "
                "drafts with its own checkpoint's DSpark module"
            )
        if not isinstance(runner, ModelRunner) or runner.parallel.is_parallel:
            raise ModelLoadError(
                "speculative method 'dspark' needs the target model in the engine's own "
                "process (decode tensor parallel 1); it reads the target's hidden states"
            )
        if any(w is not None for w in target.layer_windows):
            raise ModelLoadError(
                "speculative method 'dspark' cannot run with a sliding-window target: its "
                "draft attends over the whole context, whose blocks the window drops"
            )
        self.draft: DSparkDraft = load_dspark(Path(spec.model), runner.dtype, runner.device)
        _check(self.draft, target, spec, Path(spec.model))
        self.runner = runner
        self.stats = stats
        self.threshold = spec.threshold
        self.budget = config.max_num_batched_tokens  # positions rebuilt a step, at most
        self.hidden = TargetHidden(runner, config.max_num_batched_tokens)
        runner.model.keep_hidden = True
        runner.model.hidden_layers = self.draft.cfg.target_layer_ids
        if runner.graphs is not None:  # captured without the hidden states: again with them
            runner.recapture_graphs()
        self.kv_cache = self._new_cache()

    def _new_cache(self) -> torch.Tensor:  # [N, L_draft, 2, H_kv, B, D]
        c = self.draft.cfg.layers
        layout = KVLayout(
            num_blocks=self.runner.layout.num_blocks,
            num_layers=c.num_hidden_layers,
            num_kv_heads=c.num_key_value_heads,
            block_size=self.runner.layout.block_size,
            head_dim=c.head_dim,
            dtype=str(self.runner.dtype).removeprefix("torch."),
        )
        return new_cache(layout, self.runner.device)

    def keep(self, kept: list[tuple[str, int, int, int]], plan: StepPlan) -> None:
        """After the target's step: the features of the rows named (TargetHidden.keep)."""
        self.hidden.keep(kept)

    # -- the context's KV -------------------------------------------------------------------

    def _catch_up(self, reqs: list[Request], ends: list[int]) -> list[bool]:
        """Write the draft's KV of each request's positions [num_draft_computed, s); per
        request whether it is complete (within this step's rebuild budget)."""
        starts = [min(r.num_draft_computed, s) for r, s in zip(reqs, ends, strict=True)]
        spans, left = [], self.budget
        for req, a, s in zip(reqs, starts, ends, strict=True):
            if self.hidden.holds(req.request_id, a, s):
                spans.append((a, s))
                continue
            take = min(s - a, left)
            left -= take
            spans.append((a, a + take))
        feats = self.hidden.of(reqs, spans)
        rows = [(req, a, f) for req, (a, b), f in zip(reqs, spans, feats, strict=True) if b > a]
        if rows:
            positions = torch.cat([torch.arange(a, a + f.shape[0]) for _, a, f in rows])
            slots = torch.tensor(
                [_slot(req.block_ids, p, self.runner.layout.block_size)
                 for req, a, f in rows for p in range(a, a + f.shape[0])]
            )  # fmt: skip
            kvs = self.draft.context_kv(torch.cat([f for _, _, f in rows]),
                                        positions.to(self.runner.device))  # fmt: skip
            slots = slots.to(self.runner.device)
            for layer, (k, v) in enumerate(kvs):
                kernels.write_kv(self.kv_cache[:, layer], k, v, slots)
        done = []
        for req, (_, b), s in zip(reqs, spans, ends, strict=True):
            req.num_draft_computed = b
            done.append(b == s)
        return done

    def _context(self, req: Request, end: int, layer: int) -> KV:
        """The draft's keys and values of positions [0, end) of one layer [end, H_kv, D]."""
        size = self.runner.layout.block_size
        num = -(-end // size)
        blocks = torch.tensor(req.block_ids[:num], device=self.runner.device)
        kv = self.kv_cache[blocks, layer]  # [nb, 2, H_kv, B, D]
        kv = kv.permute(1, 0, 3, 2, 4).reshape(2, num * size, kv.shape[2], kv.shape[4])
        return kv[0, :end], kv[1, :end]

    # -- proposing --------------------------------------------------------------------------

    @torch.inference_mode()
    def propose(self, reqs: list[Request], seqs: list[ScheduledSeq]) -> list[Draft]:
        """``seqs``: the target's verify seqs of ``reqs`` (blocks allocated for the drafts).
        A request still catching up gets an empty draft (deferred)."""
        if self.kv_cache.shape[0] != self.runner.layout.num_blocks:  # the target's resized
            self.kv_cache = self._new_cache()
        ends = [s.start_position for s in seqs]  # s: the position of the last real token
        ready = self._catch_up(reqs, ends)
        out = [Draft([]) for _ in reqs]
        picked = [i for i, ok in enumerate(ready) if ok]
        self.stats.num_deferred += len(reqs) - len(picked)
        if not picked:
            return out
        device = self.runner.device
        anchors = torch.tensor([seqs[i].token_ids[0] for i in picked], device=device)
        context = [
            [self._context(reqs[i], ends[i], layer) for i in picked]
            for layer in range(len(self.draft.layers))
        ]
        hidden = self.draft.block(anchors, torch.tensor([ends[i] for i in picked],
                                  device=device), context)  # [P, B, hidden]  # fmt: skip
        drafts = draw_block(self.draft, hidden, anchors, [reqs[i] for i in picked],
                            [seqs[i] for i in picked], self.threshold)  # fmt: skip
        for i, d in zip(picked, drafts, strict=True):
            out[i] = d
        return out


class BlockDraft(Protocol):
    """What :func:`draw_block` reads of a DSpark draft (Qwen3's or DeepSeek-V4's)."""

    def prev_embed(self, prev: torch.Tensor) -> torch.Tensor | None: ...

    def row_logits(
        self, h: torch.Tensor, embed: torch.Tensor | None, state: Any
    ) -> tuple[torch.Tensor, Any]: ...

    def confidence(self, h: torch.Tensor, embed: torch.Tensor | None) -> torch.Tensor | None: ...


def draw_block(
    draft: BlockDraft,
    hidden: torch.Tensor,  # [P, B, hidden]: each picked sequence's block rows
    anchors: torch.Tensor,  # [P]: their last tokens
    reqs: list[Request],
    seqs: list[ScheduledSeq],
    threshold: float,
) -> list[Draft]:
    """Each block's drafts row by row (greedy, or sampled from the request's distribution
    with its draft probabilities kept for rejection sampling), the Markov head fed the
    token before; verified up to the first row whose confidence falls below
    ``threshold`` (DeepSpec's rule)."""
    device = hidden.device
    nums = [min(seq.num_drafts, hidden.shape[1]) for seq in seqs]
    gens = [
        None if req.sampling.is_greedy else
        token_generator(req.sampling.seed, DRAFT_STREAM + len(req.output_token_ids), device)
        for req in reqs
    ]  # fmt: skip
    tokens: list[list[int]] = [[] for _ in reqs]
    probs: list[list[torch.Tensor]] = [[] for _ in reqs]
    verified = list(nums)  # how many of each block's drafts go to the target
    prev, state = anchors, None
    for j in range(max(nums)):
        h = hidden[:, j]
        embed = draft.prev_embed(prev)
        logits, state = draft.row_logits(h, embed, state)  # [P, V]
        conf = draft.confidence(h, embed)
        nxt = []
        for n, req in enumerate(reqs):
            if j >= nums[n]:
                nxt.append(0)
                continue
            gen = gens[n]
            if gen is None:
                nxt.append(int(logits[n].argmax()))
            else:
                q = row_probs(logits[n], req.sampling)  # [V]
                nxt.append(int(torch.multinomial(q, 1, generator=gen).item()))
                probs[n].append(q)
            tokens[n].append(nxt[-1])
            if conf is not None and threshold > 0 and verified[n] > j:
                if float(torch.sigmoid(conf[n])) < threshold:
                    verified[n] = j
        prev = torch.tensor(nxt, device=device)
    return [
        Draft(tokens[n][:v], torch.stack(probs[n][:v]) if probs[n] and v else None)
        for n, v in enumerate(verified)
    ]


def _slot(block_ids: list[int], position: int, size: int) -> int:
    return block_ids[position // size] * size + position % size


def _check(draft: DSparkDraft, target: ModelConfig, spec: SpeculativeConfig, path: Path) -> None:
    """The draft fits the target and the config, else a ModelLoadError naming the mismatch."""
    cfg, c = draft.cfg, draft.cfg.layers
    problems = []
    if cfg.num_target_layers != target.num_hidden_layers:
        problems.append(
            f"it was trained on a target of {cfg.num_target_layers} layers, this one has "
            f"{target.num_hidden_layers}"
        )
    if c.hidden_size != target.hidden_size or c.vocab_size != target.vocab_size:
        problems.append(
            f"hidden size / vocabulary {c.hidden_size} / {c.vocab_size} differ from the "
            f"target's {target.hidden_size} / {target.vocab_size}"
        )
    ids = cfg.target_layer_ids
    last = target.num_hidden_layers - 1
    if not ids or list(ids) != sorted(set(ids)) or ids[0] < -1 or ids[-1] >= last:
        problems.append(
            f"target_layer_ids {list(ids)} must be strictly increasing within -1 (the "
            f"embeddings) .. {last - 1} (not the last layer, as DeepSpec requires)"
        )
    if spec.num_speculative_tokens > cfg.block_size:
        problems.append(
            f"num_speculative_tokens {spec.num_speculative_tokens} exceeds its block_size "
            f"{cfg.block_size} (the tokens one draft forward makes)"
        )
    if not 0 <= cfg.mask_token_id < c.vocab_size:
        problems.append(f"mask_token_id {cfg.mask_token_id} is outside the vocabulary")
    if problems:
        raise ModelLoadError(f"DSpark draft {path}: " + "; ".join(problems))
