"""DecodeEngine: the engine admitting requests whose prompt KV arrived from a producer."""

from __future__ import annotations

from collections.abc import Sequence

from pdserve.common.engine.kv_groups import NULL_BLOCK
from pdserve.common.engine.llm_engine import LLMEngine
from pdserve.common.engine.outputs import RequestOutput
from pdserve.common.engine.sampling import SamplingParams
from pdserve.common.errors import RequestError


class DecodeEngine(LLMEngine):
    def add_prefilled(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        first_token: int,
        sampling: SamplingParams,
        block_ids: list[int] | None,
        num_cached_tokens: int = 0,
        first_block: int = 0,
    ) -> RequestOutput:
        """Admit a request whose first token was sampled by prefill. With ``block_ids``
        (the pulled KV of the prompt from table entry ``first_block`` on: those before
        left a sliding window) decoding starts at once; without them the prompt is
        recomputed here (``kv_load_failure_policy = "recompute"``)."""
        req = self._new_request(request_id, prompt_token_ids, sampling)
        if block_ids is not None:
            req.block_ids = [NULL_BLOCK] * first_block + block_ids
            req.num_dropped_blocks = first_block
            req.num_computed_tokens = req.num_prompt_tokens
        req.num_cached_tokens = num_cached_tokens
        req.output_token_ids.append(first_token)
        self._track(req)
        return self._emit(req, first_token)

    def blocks_for_prompt(self, num_tokens: int) -> int:
        return -(-num_tokens // self.config.block_size)

    def validate(self, prompt_token_ids: Sequence[int], sampling: SamplingParams) -> None:
        super().validate(prompt_token_ids, sampling)
        # A pull lands every block of the prompt at once, even where a sliding window
        # would hold fewer while decoding.
        needed = self.blocks_for_prompt(len(prompt_token_ids))
        if needed > self.pool.num_blocks:
            raise RequestError(
                f"the prompt's KV needs {needed} blocks but the decode cache has "
                f"{self.pool.num_blocks}; shorten it or give the cache more memory"
            )
