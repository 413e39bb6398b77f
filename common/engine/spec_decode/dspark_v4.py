"""DSpark proposer for DeepSeek-V4 targets: the checkpoint's own DSpark module
(common/model/draft/dspark_v4.py) drafts a block of tokens a step from the target's streams after
the layers it names, and its confidence head may shorten what the target verifies.

State: a private rolling window per request, as the reference keeps its ring: each draft
stage's context row (one K=V row) of the last ``W`` positions (the target's
``sliding_window``), [stages, W, D] indexed by position mod W. A row depends on the
target's features at its position alone; the features come from the target's own forward
of every token it computes for the request (``DeepseekV4Model.hidden_rows``): all rows of
a prompt chunk, the one row of a plain decode, the accepted rows of a verify (rejected
drafts are never written, so nothing rolls back).

They cannot be recomputed later: the target's KV keeps only a window of per-token rows
(common/model/deepseek/dsv4_config.py), too short to run the target again over the W positions
before s. So a window with a gap -- after a prefix-cache hit (the cached prompt was never
through this request's forward), a pull on the decode side of a disaggregated deployment
(prefill never runs the draft), a step the request sat out -- fills again from fresh
target rows, and until it holds every position [max(0, s - W), s) the request proposes
nothing (its verify emits the target's one token), counted in
``SpecDecodeStats.num_deferred``. A preemption recomputes the prompt, which refills it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from pdserve.common.engine.config import EngineConfig
from pdserve.common.engine.model_runner import ModelRunner
from pdserve.common.engine.request import Request
from pdserve.common.engine.spec_decode.config import SpeculativeConfig
from pdserve.common.engine.spec_decode.dspark import draw_block
from pdserve.common.engine.spec_decode.proposal import Draft
from pdserve.common.engine.spec_decode.stats import SpecDecodeStats
from pdserve.common.engine.step_plan import ScheduledSeq, StepPlan
from pdserve.common.errors import ModelLoadError
from pdserve.common.model.checkpoint.config import ModelConfig
from pdserve.common.model.deepseek.dsv4 import DeepseekV4Model
from pdserve.common.model.draft.dspark_v4 import V4DSparkDraft, load_v4_dspark


class Window:
    """One request's context rows of positions [lo, hi), the last W at most, in a ring."""

    def __init__(self, rows: torch.Tensor) -> None:  # [stages, W, D], empty
        self.rows = rows
        self.lo = self.hi = 0

    def add(self, start: int, new: torch.Tensor) -> None:  # new [stages, n, D]: start ..
        w, n = self.rows.shape[1], new.shape[1]
        if start != self.hi:  # a gap, or positions again (a recompute): start over
            self.lo = start
        self.hi = start + n
        self.lo = max(self.lo, self.hi - w)
        keep = min(n, w)
        slots = torch.arange(self.hi - keep, self.hi, device=new.device) % w
        self.rows[:, slots] = new[:, n - keep :].to(self.rows.dtype)

    def holds_context_of(self, s: int) -> bool:
        """Whether it holds every context row a block at ``s`` attends: [s - W, s)."""
        return self.hi == s and self.lo <= max(0, s - self.rows.shape[1])

    def context(self, stage: int) -> torch.Tensor:  # [hi - lo, D] in position order
        w = self.rows.shape[1]
        slots = torch.arange(self.lo, self.hi, device=self.rows.device) % w
        return self.rows[stage, slots]


class DSparkV4Proposer:
    def __init__(
        self,
        spec: SpeculativeConfig,
        config: EngineConfig,
        target: ModelConfig,
        runner: object,
        stats: SpecDecodeStats,
    ) -> None:
        if not isinstance(runner, ModelRunner) or runner.parallel.is_parallel:
            raise ModelLoadError(
                "speculative method 'dspark' needs the target model in the engine's own "
                "process (decode tensor parallel 1); it reads the target's hidden states"
            )
        # the target's own checkpoint, or another V4 checkpoint's DSpark module
        path = Path(spec.model) if spec.model else runner.model_dir
        model: Any = runner.model  # typed CausalLM: V4's model only shares its interface
        assert isinstance(model, DeepseekV4Model)  # the speculator picks this for V4 alone
        self.model = model
        self.draft: V4DSparkDraft = load_v4_dspark(
            path, target, model.model.embed_tokens, model.head, runner.dtype, runner.device
        )
        _check(self.draft, target, spec, path)
        self.runner = runner
        self.stats = stats
        self.threshold = spec.threshold
        self.windows: dict[str, Window] = {}
        model.keep_hidden = True
        model.hidden_layers = self.draft.cfg.target_layer_ids
        if runner.graphs is not None:  # captured without the hidden rows: again with them
            runner.recapture_graphs()

    def _window(self, request_id: str) -> Window:
        w = self.windows.get(request_id)
        if w is None:
            c, d = self.draft.cfg, self.runner.cfg.head_dim
            rows = torch.zeros(c.num_stages, c.window, d, dtype=self.runner.dtype,
                               device=self.runner.device)  # fmt: skip
            w = self.windows[request_id] = Window(rows)
        return w

    @torch.inference_mode()
    def keep(self, kept: list[tuple[str, int, int, int]], plan: StepPlan) -> None:
        """After the target's step ``plan``: the context rows of every position it computed
        for good (prompt chunks and plain decodes whole, a verify's accepted rows: ``kept``
        names them). Requests the step did not run lose their windows."""
        features = self.model.hidden_rows  # [T, L * hidden], the plan's token order
        accepted = {request_id: num for request_id, _, _, num in kept}
        pieces: list[tuple[str, int, int, int]] = []  # (request, first row, position, rows)
        row, w = 0, self.draft.cfg.window
        for seq in plan.seqs:
            n = len(seq.token_ids)
            good = accepted.get(seq.request_id, n) if seq.num_drafts else n
            skip = max(0, good - w)  # a long chunk: only its last W rows can be read
            pieces.append((seq.request_id, row + skip, seq.start_position + skip, good - skip))
            row += n
        self.windows = {p[0]: self.windows[p[0]] for p in pieces if p[0] in self.windows}
        if features is None or not pieces:
            return
        index = torch.cat([torch.arange(r, r + n) for _, r, _, n in pieces])
        positions = torch.cat([torch.arange(p, p + n) for _, _, p, n in pieces])
        rows = self.draft.context_rows(
            features[index.to(features.device)], positions.to(features.device)
        )  # [stages, sum n, D]
        at = 0
        for request_id, _, position, n in pieces:
            self._window(request_id).add(position, rows[:, at : at + n])
            at += n

    @torch.inference_mode()
    def propose(self, reqs: list[Request], seqs: list[ScheduledSeq]) -> list[Draft]:
        """``seqs``: the target's verify seqs of ``reqs``. A request whose window has a gap
        gets an empty draft (deferred)."""
        ends = [s.start_position for s in seqs]  # s: the position of the last real token
        out = [Draft([]) for _ in reqs]
        picked = [
            i for i, (r, s) in enumerate(zip(reqs, ends, strict=True))
            if r.request_id in self.windows and self.windows[r.request_id].holds_context_of(s)
        ]  # fmt: skip
        self.stats.num_deferred += len(reqs) - len(picked)
        if not picked:
            return out
        device = self.runner.device
        anchors = torch.tensor([seqs[i].token_ids[0] for i in picked], device=device)
        context = [
            [self.windows[reqs[i].request_id].context(stage) for i in picked]
            for stage in range(self.draft.cfg.num_stages)
        ]
        positions = torch.tensor([ends[i] for i in picked], device=device)
        hidden = self.draft.block(anchors, positions, context)  # [P, B, hidden]
        drafts = draw_block(self.draft, hidden, anchors, [reqs[i] for i in picked],
                            [seqs[i] for i in picked], self.threshold)  # fmt: skip
        for i, d in zip(picked, drafts, strict=True):
            out[i] = d
        return out


def _check(draft: V4DSparkDraft, target: ModelConfig, spec: SpeculativeConfig, path: Path) -> None:
    """The module fits the target and the config, else a ModelLoadError naming the mismatch."""
    cfg = draft.cfg
    problems = []
    ids, last = cfg.target_layer_ids, target.num_hidden_layers - 1
    if not ids or list(ids) != sorted(set(ids)) or ids[0] < 0 or ids[-1] > last:
        problems.append(
            f"dspark_target_layer_ids {list(ids)} must be strictly increasing within 0 .. {last}"
        )
    if spec.num_speculative_tokens > cfg.block_size:
        problems.append(
            f"num_speculative_tokens {spec.num_speculative_tokens} exceeds its "
            f"dspark_block_size {cfg.block_size} (the tokens one draft forward makes)"
        )
    if not 0 <= cfg.mask_token_id < target.vocab_size:
        problems.append(f"dspark_noise_token_id {cfg.mask_token_id} is outside the vocabulary")
    if problems:
        raise ModelLoadError(f"DSpark module of {path}: " + "; ".join(problems))
