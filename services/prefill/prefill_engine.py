"""PrefillEngine: the engine with requests that end at their first token, their KV
blocks pinned instead of freed, for decode to pull. The engine holds each pin until its
service ends the lease (``unpin``: every replica released, or the lease expired)."""

from __future__ import annotations

import msgspec

from pdserve.common.engine.engine_core import EngineCore
from pdserve.common.engine.request import Request
from pdserve.common.engine.sampling_params import TokenLogprobs


class Prefilled(msgspec.Struct, kw_only=True):
    request_id: str
    first_token: int
    block_ids: list[int]  # pinned until ``PrefillEngine.unpin`` (release or lease expiry)
    host_slots: list[int] = []  # KVHandle.host_slots: tier slots pinned the same way
    first_block: int  # the table entry of block_ids[0]: those before left a sliding window
    num_tokens: int  # prompt tokens whose K/V the blocks hold
    # several KV cache groups: block_ids hold each group's kept blocks, group after group;
    # these are the first kept entries of groups 1.. (common/engine/kv_groups.py)
    group_first_blocks: list[int] = []
    num_cached_tokens: int
    logprobs: list[TokenLogprobs] = []  # the first token's, when the request asked for them
    prompt_logprobs: list[TokenLogprobs] | None = None  # entry i: prompt token i + 1's


class PrefillEngine(EngineCore[Prefilled]):
    holds_output = False

    def _advance(self, req: Request, token_id: int) -> Prefilled:
        req.output_token_ids.append(token_id)
        del self._requests[req.request_id]
        first_block, *group_first_blocks = req.dropped
        block_ids, host_slots = self.scheduler.pin(req)
        return Prefilled(
            request_id=req.request_id,
            first_token=token_id,
            first_block=first_block,
            group_first_blocks=group_first_blocks,
            block_ids=block_ids,
            host_slots=host_slots,
            num_tokens=req.num_prompt_tokens,
            num_cached_tokens=req.num_cached_tokens,
        )

    def unpin(self, request_id: str) -> bool:
        """Free the blocks pinned for ``request_id``; False when none are (unpinned already)."""
        return self.scheduler.unpin(request_id)
