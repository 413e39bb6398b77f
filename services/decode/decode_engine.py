"""DecodeEngine: the engine admitting requests whose prompt KV arrived from a producer."""

from __future__ import annotations

from collections.abc import Sequence

from pdserve.common.engine.kv_groups import num_pulled_blocks, tables_of_pulled
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
        group_first_blocks: Sequence[int] = (),
    ) -> RequestOutput:
        """Admit a request whose first token was sampled by prefill. With ``block_ids``
        (the pulled KV of the prompt from table entry ``first_block`` on: those before
        left a sliding window; with several KV cache groups, each group's blocks in turn,
        ``group_first_blocks`` the first entries of groups 1..) decoding starts at once;
        without them the prompt is recomputed here (``kv_load_failure_policy =
        "recompute"``)."""
        req = self._new_request(request_id, prompt_token_ids, sampling)
        if block_ids is not None:
            firsts = [first_block, *group_first_blocks]
            self.check_groups(len(firsts))
            req.tables = tables_of_pulled(
                block_ids, req.num_prompt_tokens, self.config.block_size, firsts
            )
            req.dropped = firsts
            req.num_computed_tokens = req.num_prompt_tokens
        req.num_cached_tokens = num_cached_tokens
        req.output_token_ids.append(first_token)
        self._track(req)
        return self._emit(req, first_token)

    def blocks_to_pull(self, num_tokens: int, first_blocks: Sequence[int]) -> int:
        """Local blocks a pull of a handle lands in: every group's kept entries."""
        self.check_groups(len(first_blocks))
        return num_pulled_blocks(num_tokens, self.config.block_size, first_blocks)

    def check_groups(self, num: int) -> None:
        if num != len(self.kv_groups):
            raise RequestError(
                f"the KV handle has blocks of {num} KV cache groups but this decode's cache "
                f"has {len(self.kv_groups)}; run prefill and decode with the same model"
            )

    def validate(self, prompt_token_ids: Sequence[int], sampling: SamplingParams) -> None:
        super().validate(prompt_token_ids, sampling)
        # A pull lands the blocks of the prompt each group keeps (a sliding group: those
        # its window of the first decode query reaches) at once.
        needed = self.scheduler.tables.max_blocks(len(prompt_token_ids), 1)
        if needed > self.pool.num_blocks:
            raise RequestError(
                f"the prompt's KV needs {needed} blocks but the decode cache has "
                f"{self.pool.num_blocks}; shorten it or give the cache more memory"
            )
