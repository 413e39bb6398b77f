"""The monolithic engine: Scheduler + one ModelRunner + Sampler in one process.

It is the reference the disaggregated services are checked against, token for token.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from pdserve.common.engine.engine_core import EngineCore
from pdserve.common.engine.outputs import Completion, RequestOutput, finish_reason
from pdserve.common.engine.request import Request
from pdserve.common.engine.sampling import SamplingParams, TokenLogprobs
from pdserve.common.errors import RequestError


class LLMEngine(EngineCore[RequestOutput]):
    """The monolithic engine: every sampled token streamed, requests end on stop rules."""

    supports_async = True

    def _advance(self, req: Request, token_id: int) -> RequestOutput:
        req.output_token_ids.append(token_id)
        return self._emit(req, token_id)

    def _resolved(self, req: Request, token_id: int) -> RequestOutput:
        return self._emit(req, token_id)

    def _advance_many(
        self, req: Request, token_ids: list[int], logprobs: list[TokenLogprobs | None]
    ) -> RequestOutput:
        """One output for the step's tokens, as if each had come from its own step: the
        first stop rule that fires ends the request there and drops the tokens after it."""
        merged: RequestOutput | None = None
        for token_id, lp in zip(token_ids, logprobs, strict=True):
            out = self._advance(req, token_id)
            if lp is not None:
                out.logprobs = [lp]
            if merged is None:
                merged = out
            else:
                merged.new_token_ids += out.new_token_ids
                merged.text += out.text
                merged.logprobs += out.logprobs
                merged.finished, merged.finish_reason = out.finished, out.finish_reason
                merged.num_output_tokens = out.num_output_tokens
            if out.finished:
                break
        assert merged is not None
        return merged

    def _emit(self, req: Request, token_id: int) -> RequestOutput:
        """The output for ``req``'s newest token; ends the request on a stop rule."""
        tracker = self._requests[req.request_id][1]
        reason = finish_reason(req, token_id, self.eos_token_ids, self.max_model_len)
        if reason == "stop" and not req.sampling.include_stop_str_in_output:
            # a stop token's text is not part of the answer
            text, hit_stop_string = "", False
        else:
            text, hit_stop_string = tracker.add(token_id)
        if hit_stop_string:
            reason = "stop"
        if reason is None:
            return self._output(req, [token_id], text, None)
        text += tracker.flush()
        self.scheduler.finish(req, reason)
        del self._requests[req.request_id]
        return self._output(req, [token_id], text, reason)

    # -- convenience ----------------------------------------------------------------------

    def generate(
        self, prompts: Iterable[Sequence[int]], sampling: SamplingParams | Sequence[SamplingParams]
    ) -> list[Completion]:
        """Run prompts (token ids) to completion together; results in prompt order."""
        prompts = list(prompts)
        params = (
            [sampling] * len(prompts) if isinstance(sampling, SamplingParams) else list(sampling)
        )
        ids = [f"gen-{next(self._arrivals)}" for _ in prompts]
        for rid, prompt, p in zip(ids, prompts, params, strict=True):
            self.add_request(rid, prompt, p)
        texts: dict[str, list[str]] = {rid: [] for rid in ids}
        tokens: dict[str, list[int]] = {rid: [] for rid in ids}
        done: dict[str, RequestOutput] = {}
        while len(done) < len(ids):
            outputs = self.step()
            if self.last_step_tokens == 0:
                # Here nothing else holds blocks, so an empty step would repeat forever.
                raise RuntimeError(f"scheduler made no progress: {self.scheduler.waiting[0]!r}")
            for rid, why in self.take_failures():
                raise RequestError(f"request {rid}: {why}")
            for out in outputs:
                texts[out.request_id].append(out.text)
                tokens[out.request_id] += out.new_token_ids
                if out.finished:
                    done[out.request_id] = out
        return [
            Completion(
                request_id=rid,
                text="".join(texts[rid]),
                token_ids=tokens[rid],
                finish_reason=done[rid].finish_reason,
                num_prompt_tokens=done[rid].num_prompt_tokens,
                num_cached_tokens=done[rid].num_cached_tokens,
            )
            for rid in ids
        ]
