"""The engine's core: requests in, scheduled steps run by a ModelRunner, tokens sampled and
handed to a hook (``_advance``) that says what a token means to its request. The monolithic
engine (llm_engine.py) streams every token; prefill's (services/prefill/prefill_engine.py)
hands a request over at its first.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from typing import Any, Generic, Protocol, TypeVar, cast

import structlog
import torch

from pdserve.common.engine.async_steps import NAN_MESSAGE, InFlight, is_plain, launch_greedy
from pdserve.common.engine.block_pool import BlockPool
from pdserve.common.engine.config import EngineConfig
from pdserve.common.engine.cuda_graphs import graph_sizes
from pdserve.common.engine.fair_batch import DecodeCurve, ladder, parse_mode
from pdserve.common.engine.host_tier import HostTier
from pdserve.common.engine.kv_groups import cache_groups
from pdserve.common.engine.kv_layout import KVLayout
from pdserve.common.engine.model_runner import ModelRunner
from pdserve.common.engine.outputs import RequestOutput, TextTracker
from pdserve.common.engine.prompt_logprobs import PromptScores, in_order
from pdserve.common.engine.request import Request
from pdserve.common.engine.sampling import (
    Sampler,
    SamplingParams,
    TokenLogprobs,
    not_finite,
    token_logprobs,
)
from pdserve.common.engine.scheduler import Scheduler
from pdserve.common.engine.spec_decode.speculator import Speculator
from pdserve.common.engine.step_plan import StepPlan
from pdserve.common.engine.structured import GrammarTable
from pdserve.common.engine.tier_buffer import TierBuffer, num_tier_slots
from pdserve.common.errors import PdserveError, RequestError
from pdserve.common.model.checkpoint.config import ModelConfig
from pdserve.common.model.checkpoint.files import resolve_model
from pdserve.common.model.checkpoint.tokenizer import Tokenizer

log = structlog.get_logger("pdserve.engine")


class StepRunner(Protocol):
    """What the engine needs of whatever executes its steps."""

    layout: KVLayout
    last_prompt_logprobs: PromptScores  # the last step's (common/engine/prompt_logprobs.py)

    def execute(self, plan: StepPlan) -> torch.Tensor: ...


OutputT = TypeVar("OutputT")


class EngineCore(Generic[OutputT]):
    """Scheduler + runner + sampler. What a sampled token makes of its request is the
    subclass's hook, ``_advance``: the monolithic engine streams it (``LLMEngine``), prefill
    hands the request over with its blocks pinned (``PrefillEngine``)."""

    holds_output = True  # the KV of generated tokens lives here too (not so on prefill)
    supports_async = False  # whether ``_resolved`` is implemented (async_steps.py)

    def __init__(self, config: EngineConfig, runner: StepRunner | None = None) -> None:
        """``runner`` replaces the in-process ModelRunner (prefill's PCP rank group)."""
        if config.device == "cuda":
            if not torch.cuda.is_available():
                raise RequestError("device 'cuda' was asked for but torch sees no CUDA device")
        self.config = config
        self.model_dir = resolve_model(config.model)
        self.model_config = ModelConfig.from_dir(self.model_dir)
        self.tokenizer = Tokenizer.from_dir(self.model_dir)
        self.max_model_len = config.max_model_len or self.model_config.max_position_embeddings
        self.runner: StepRunner = runner or ModelRunner.from_config(
            self.model_config, self.model_dir, config
        )
        self.pool = BlockPool(self.runner.layout.num_blocks, config.enable_prefix_caching)
        # One block table per KV cache group (common/engine/kv_groups.py): sliding groups
        # return the blocks behind their window, full groups keep every block.
        self.kv_groups = cache_groups(self.model_config)
        spec = config.speculative_config if self.holds_output else None
        self.speculator = (
            None
            if spec is None
            else Speculator(
                spec,
                config,
                self.model_config,
                self.tokenizer,
                self.runner.layout.num_blocks,
                runner=self.runner,
            )
        )
        self.scheduler = Scheduler(
            self.pool,
            config.block_size,
            config.max_num_seqs,
            config.max_num_batched_tokens,
            num_speculative_tokens=spec.num_speculative_tokens if spec else 0,
            max_model_len=self.max_model_len,
            groups=self.kv_groups,
        )
        # Fair decode batches (fair_batch.py): buckets on CUDA are the graph sizes, so a
        # capped step replays a captured graph
        self.scheduler.fair_decode_batch = parse_mode(config.fair_decode_batch)
        sizes = graph_sizes(config.cuda_graph_max_batch) if config.device == "cuda" else []
        self.scheduler.decode_curve = DecodeCurve(ladder(config.max_num_seqs, sizes))
        # the last launched step: its sequences if all decoded (else 0), and whether more
        # than one client decoded in it
        self._decode_step = (0, False)
        self._logged_cap: int | None = None
        if config.kv_host_cache_gb > 0:
            self.pool.tier = self._host_tier(config.kv_host_cache_gb)
        self.eos_token_ids = frozenset(self.tokenizer.eos_token_ids) | frozenset(
            self.model_config.eos_token_ids
        )
        grammars = GrammarTable(self.model_dir, self.model_config.vocab_size)
        self.sampler = Sampler(self.eos_token_ids, grammars)
        self._requests: dict[str, tuple[Request, TextTracker]] = {}
        self.last_step_tokens = 0  # tokens the last step computed; 0: it had nothing to run
        self.failures: list[tuple[str, str]] = []  # take_failures()
        self._arrivals = itertools.count()
        # Asynchronous scheduling (async_steps.py): the in-process runner carries tokens
        self._async_runner: ModelRunner | None = None
        if (
            config.is_async_scheduling
            and self.supports_async
            and self.speculator is None
            and isinstance(self.runner, ModelRunner)
        ):
            self._async_runner = self.runner
            device = self.runner.device
            self.pool.wait_idle = (
                (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else None
            )
        self._in_flight: InFlight | None = None
        self._serials = itertools.count(1)
        self.last_step_launched = False  # the last step() launched a step

    def _host_tier(self, gigabytes: float) -> HostTier:
        """A host tier of ``gigabytes`` GiB under the pool (common/engine/host_tier.py)."""
        groups = self.kv_groups
        if len(groups) != 1 or groups[0].is_sliding or groups[0].rate != 1:
            raise PdserveError(
                f"kv_host_cache_gb: {self.model_dir.name} has sliding-window or compressed KV "
                "cache groups; the host tier holds one full-attention group only (set 0)"
            )
        if not isinstance(self.runner, ModelRunner) or self.speculator is not None:
            raise PdserveError(
                "kv_host_cache_gb: the host tier needs a one-rank engine (TP 1, PCP 1) without "
                "speculative decoding for now; set 0"
            )
        layout = self.runner.layout
        buffer = TierBuffer(self.runner, layout, num_tier_slots(gigabytes, layout))
        log.info(
            "host_tier_ready",
            num_blocks=buffer.layout.num_blocks,
            host_mib=round(buffer.layout.total_bytes / 2**20),
        )
        return HostTier(buffer.layout.num_blocks, buffer)

    def close(self) -> None:
        """Give back what outlives the requests: the host tier's blocks and memory, the
        grammar compile workers."""
        if self.sampler.grammars is not None:
            self.sampler.grammars.close()
        if self.pool.tier is not None:
            self.pool.tier.clear()
            self.pool.tier = None

    # -- requests -------------------------------------------------------------------------

    def validate(self, prompt_token_ids: Sequence[int], sampling: SamplingParams) -> None:
        sampling.validate(self.model_config.vocab_size)
        if self.speculator is not None and sampling.structured is not None:
            raise RequestError(
                "structured output cannot be combined with speculative decoding here (the "
                "grammar would have to follow the drafts and roll back); use an instance "
                "without speculative_config"
            )
        if sampling.structured is not None and self.sampler.grammars is not None:
            self.sampler.grammars.compile(sampling.structured)  # a bad schema fails here
        num = len(prompt_token_ids)
        if num == 0:
            raise RequestError("the prompt is empty")
        if num > self.max_model_len:
            raise RequestError(
                f"the prompt has {num} tokens, more than max_model_len {self.max_model_len}"
            )
        vocab = self.model_config.vocab_size
        bad = next((t for t in prompt_token_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise RequestError(f"token id {bad} is outside the vocabulary (0..{vocab - 1})")
        longest = min(num + sampling.max_tokens, self.max_model_len) if self.holds_output else num
        needed = self.scheduler.max_blocks(longest, num)
        if needed > self.pool.num_blocks:
            raise RequestError(
                f"the request needs up to {needed} KV blocks but the cache has "
                f"{self.pool.num_blocks}; shorten it or give the cache more memory"
            )

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        sampling: SamplingParams,
        client: str = "",
        priority: int = 0,
    ) -> None:
        """``client`` / ``priority``: whose request it is and how urgent (lower first):
        the scheduler's waiting line serves by them (scheduler.py)."""
        self._track(self._new_request(request_id, prompt_token_ids, sampling, client, priority))

    def _new_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        sampling: SamplingParams,
        client: str = "",
        priority: int = 0,
    ) -> Request:
        if request_id in self._requests:
            raise RequestError(f"request id {request_id!r} is already in use")
        self.validate(prompt_token_ids, sampling)
        return Request(request_id, list(prompt_token_ids), sampling, next(self._arrivals),
                       client=client, priority=priority)  # fmt: skip

    def _track(self, req: Request) -> None:
        p = req.sampling
        tracker = TextTracker(self.tokenizer, p.stop, min_tokens=p.min_tokens,
                              include_stop=p.include_stop_str_in_output)  # fmt: skip
        self._requests[req.request_id] = (req, tracker)
        if req.remote is None:
            self.scheduler.add(req)
        else:  # its prompt's KV is pulled first (services/decode/decode_engine.py)
            self.scheduler.add_remote(req)

    def abort(self, request_id: str) -> RequestOutput | None:
        entry = self._requests.pop(request_id, None)
        if entry is None:
            return None
        req, _ = entry
        self.scheduler.num_abandoned_tokens += req.num_step_tokens  # nobody waits for them
        self.scheduler.finish(req, "abort")
        return self._output(req, [], "", "abort")

    @property
    def is_async_scheduling(self) -> bool:
        """Whether steps overlap the host's work (common/engine/async_steps.py)."""
        return self._async_runner is not None

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished or self._in_flight is not None

    # -- stepping -------------------------------------------------------------------------

    def step(self) -> list[OutputT]:
        """Run one step. With asynchronous scheduling the outputs returned are those of
        the step launched by the previous call (common/engine/async_steps.py)."""
        start = time.perf_counter()
        previous = self._decode_step
        try:
            outputs = self._step()
        except BaseException as exc:
            self._abandon_in_flight(exc)
            raise
        if self.scheduler.fair_decode_batch == "auto" and self._decode_step[0]:
            # A decode step's time for the fair cap's curve: with asynchronous steps the
            # call waited for the previous step (launched the call before), so it is that
            # step's (in a run of decode steps); else this one's.
            # (whether more than one client decoded in it: the share of time the cap costs)
            batch, shared = previous if self._async_runner is not None else self._decode_step
            if batch:
                self.scheduler.decode_curve.observe(batch, time.perf_counter() - start, shared)
        cap = self.scheduler.decode_cap  # logged when it changes (not probes, not "none")
        if cap is not None and cap != self._logged_cap and not self.scheduler.decode_probe:
            self._logged_cap = cap
            curve = self.scheduler.decode_curve
            log.info("fair_decode_cap", cap=cap, curve=curve.summary(),
                     presence=round(curve.presence, 2), share=round(curve.share_asked(), 3))  # fmt: skip
        return outputs

    def _step(self) -> list[OutputT]:
        plan, reqs = self.scheduler.schedule()
        all_decode = all(s.sample and len(s.token_ids) == 1 + s.num_drafts for s in plan.seqs)
        self._decode_step = (len(plan.seqs) if all_decode else 0, self.scheduler.decode_shared)
        in_flight = self._in_flight  # cleared once its tokens are read (_abandon_in_flight)
        self.last_step_launched = bool(plan.seqs)
        if not plan.seqs:  # nothing fits now (prefill: blocks pinned until decode pulls)
            self.last_step_tokens = in_flight.num_tokens if in_flight else 0
            outputs = self._finish_in_flight(in_flight) if in_flight else []
            self.pool.fence = None
            self.pool.unfence()
            return outputs
        self.last_step_tokens = plan.num_tokens
        if self.speculator is not None:  # never asynchronous (async_steps.py)
            return self._speculative_step(plan, reqs)
        carry = in_flight.carry(reqs) if in_flight else None
        if self._async_runner is not None:
            self.pool.fence = next(self._serials)
            logits = self._async_runner.execute(plan, carry)
        else:
            logits = self.runner.execute(plan)
        for request_id, entries in self.runner.last_prompt_logprobs.items():
            if request_id in self._requests:
                self._requests[request_id][0].prompt_scores.update(entries)
        sampled = [req for req, seq in zip(reqs, plan.seqs, strict=True) if seq.sample]
        launched = None
        if self._async_runner is not None and all(is_plain(r.sampling) for r in sampled):
            assert self.pool.fence is not None
            params = [r.sampling for r in sampled]
            launched = launch_greedy(logits, self.pool.fence, plan.num_tokens, params)
        # the previous step's tokens: some requests of this step may end there
        outputs = self._finish_in_flight(in_flight) if in_flight else []
        rows = list(range(len(sampled)))  # of the logits
        if any(req.is_finished for req in reqs):  # their rows were computed for nothing
            alive = [i for i, req in enumerate(reqs) if not req.is_finished]
            rows = [j for j in rows if not sampled[j].is_finished]
            logits = logits[torch.tensor(rows, dtype=torch.long, device=logits.device)]
            plan = StepPlan([plan.seqs[i] for i in alive])
            reqs = [reqs[i] for i in alive]
            sampled = [sampled[j] for j in rows]
        self.scheduler.on_step_done(reqs, plan)
        if launched is not None:
            for row, req in zip(rows, sampled, strict=True):
                launched.add(row, req)
            self._in_flight = launched
            return outputs
        outputs += self._sample(logits, sampled)
        self.pool.fence = None  # the sampler read the tokens: the step is done
        self.pool.unfence()
        return outputs

    def _sample(self, logits: torch.Tensor, sampled: list[Request]) -> list[OutputT]:
        """Sample on the host: every row with its own parameters (sampling.py)."""
        tokens = self.sampler(
            logits,
            [r.sampling for r in sampled],
            [len(r.output_token_ids) for r in sampled],
            [(r.prompt_token_ids, r.output_token_ids) for r in sampled],
            [r.request_id for r in sampled],
        )
        if self.sampler.failed_rows:  # those requests end here, the others go on
            keep = [i for i in range(len(sampled)) if i not in self.sampler.failed_rows]
            for row, why in self.sampler.failed_rows.items():
                self._fail_request(sampled[row], f"sampling failed: {why}")
            logits = logits[torch.tensor(keep, dtype=torch.long, device=logits.device)]
            sampled = [sampled[i] for i in keep]
            tokens = [tokens[i] for i in keep]
        outputs = [self._advance(req, tok) for req, tok in zip(sampled, tokens, strict=True)]
        if any(r.sampling.logprobs is not None for r in sampled):
            params = [r.sampling for r in sampled]
            for out, lp in zip(outputs, token_logprobs(logits, params, tokens), strict=True):
                if lp is not None:  # a RequestOutput, or prefill's Prefilled: both have it
                    cast(Any, out).logprobs = [lp]
        for req, out in zip(sampled, outputs, strict=True):
            if req.sampling.prompt_logprobs is not None and len(req.output_token_ids) == 1:
                # the first token's output: both output kinds carry the prompt's logprobs
                scores = in_order(req.num_prompt_tokens, req.prompt_scores)
                cast(Any, out).prompt_logprobs = scores
                req.prompt_scores = {}
        if self.sampler.grammars is not None and self.sampler.grammars.num_matchers:
            self.sampler.grammars.prune(self._requests)
        return outputs

    def _finish_in_flight(self, in_flight: InFlight) -> list[OutputT]:
        """The launched step's tokens in place of its placeholders, through the stop rules."""
        tokens, nan = in_flight.wait()
        self._in_flight = None
        self.pool.unfence(upto=in_flight.serial)
        outputs: list[OutputT] = []
        for entry, token, bad in zip(in_flight.rows, tokens, nan, strict=True):
            if entry is None:
                continue
            req, slot = entry
            if req.is_finished:  # aborted, or failed, while the step ran
                continue
            if bad:
                why = NAN_MESSAGE if req.sampling.is_greedy else not_finite(req.sampling)
                self._fail_request(req, f"sampling failed: {why}")
                continue
            req.output_token_ids[slot] = token
            outputs.append(self._resolved(req, token))
        return outputs

    def _abandon_in_flight(self, exc: BaseException) -> None:
        """A step failed: the requests whose token was on the device fail with it (their
        state cannot be trusted); every held free takes effect once the device is idle."""
        in_flight, self._in_flight = self._in_flight, None
        if self.pool.wait_idle is not None:
            try:
                self.pool.wait_idle()
            except Exception:  # the device itself failed: the frees are moot
                log.warning("device_wait_failed_after_step_error", exc_info=True)
        self.pool.fence = None
        self.pool.unfence()
        for entry in in_flight.rows if in_flight else []:
            if entry is not None and not entry[0].is_finished:
                self._fail_request(entry[0], f"a step failed: {exc}")

    def _fail_request(self, req: Request, why: str) -> None:
        self._requests.pop(req.request_id, None)
        self.scheduler.finish(req, "abort")
        self.failures.append((req.request_id, why))

    def take_failures(self) -> list[tuple[str, str]]:
        """Requests the last steps ended because they alone failed (request id, why)."""
        out, self.failures = self.failures, []
        return out

    def _speculative_step(self, plan: StepPlan, reqs: list[Request]) -> list[OutputT]:
        """Propose, verify in one forward, roll back what was rejected, emit the rest."""
        assert self.speculator is not None
        plan = self.speculator.fill(plan, reqs)
        logits = self.runner.execute(plan)  # [plan.num_logits, V]
        verified = self.speculator.verify(logits, plan, reqs, self.sampler)
        rejected = {id(req): void for req, _, _, void in verified}
        self.scheduler.on_step_done(reqs, plan, [rejected.get(id(r), 0) for r in reqs])
        return [self._advance_many(req, tokens, lps) for req, tokens, lps, _ in verified]

    def _advance_many(
        self, req: Request, token_ids: list[int], logprobs: list[TokenLogprobs | None]
    ) -> OutputT:
        """The hook of a verify step: ``req`` gained ``token_ids`` (accepted drafts + one)."""
        raise NotImplementedError(f"{type(self).__name__} does not decode speculatively")

    def _output(
        self, req: Request, tokens: list[int], text: str, reason: str | None
    ) -> RequestOutput:
        return RequestOutput(
            request_id=req.request_id,
            new_token_ids=tokens,
            text=text,
            finished=reason is not None,
            finish_reason=reason,
            num_prompt_tokens=req.num_prompt_tokens,
            num_cached_tokens=req.num_cached_tokens,
            num_output_tokens=len(req.output_token_ids),
        )

    def _advance(self, req: Request, token_id: int) -> OutputT:
        """The hook: ``req`` sampled ``token_id`` (not yet appended to its output)."""
        raise NotImplementedError

    def _resolved(self, req: Request, token_id: int) -> OutputT:
        """The hook of asynchronous steps: ``token_id`` took its placeholder in the output."""
        raise NotImplementedError(f"{type(self).__name__} does not schedule asynchronously")
