"""Engine-side state of one request."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from pdserve.common.engine.block_pool import BlockHash
from pdserve.common.engine.sampling import SamplingParams
from pdserve.common.engine.sampling_params import TokenLogprobs

# The newest output token of a request whose step is still on the device (asynchronous
# scheduling, common/engine/async_steps.py): the next step reads the real one there.
PENDING_TOKEN = -2


class Status(enum.Enum):
    WAITING = "waiting"
    # Decode: its prompt's KV comes from a producer; the scheduler reserves the blocks the
    # pull lands in and admits it when the pull is done (common/engine/scheduler.py).
    WAITING_FOR_REMOTE_KV = "waiting_for_remote_kv"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(frozen=True)
class RemoteKV:
    """Where a decode request's prompt KV comes from, as its KV handle says."""

    num_tokens: int  # prompt tokens whose K/V the producer's blocks hold
    # per KV cache group, the first table entry the handle lists (those before left a
    # sliding window: common/engine/kv_groups.py)
    first_blocks: tuple[int, ...]
    first_token: int  # sampled by the producer
    num_cached_tokens: int = 0  # the producer's prefix-cache hits, reported in usage


class Request:
    """Tokens, blocks and progress of one sequence.

    ``num_computed_tokens`` counts tokens whose K/V sit in the cache; the next step
    computes ``all_token_ids[num_computed_tokens : ...]``. Prefill and decode are the same
    operation: decode is a step that computes the one token sampled last.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling: SamplingParams,
        arrival_order: int = 0,
        client: str = "",
        priority: int = 0,
    ) -> None:
        self.request_id = request_id
        # whose it is and its priority (lower first): the waiting line's order (scheduler.py)
        self.client = client
        self.priority = priority
        self.num_step_tokens = 0  # tokens steps computed for it here (abandoned on abort)
        # the scheduler's turn it last decoded in (several clients: fair caps, scheduler.py)
        self.last_step = 0
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.sampling = sampling
        self.arrival_order = arrival_order
        self.status = Status.WAITING
        self.remote: RemoteKV | None = None  # decode: the KV handle its prompt comes from
        # One block table per KV cache group (common/engine/kv_groups.py): entry i holds
        # positions i * block_size ..; the leading ``dropped[g]`` entries of group g are
        # NULL_BLOCK (returned: behind its sliding window). Group 0's table is ``block_ids``.
        self.tables: list[list[int]] = [[]]
        self.dropped: list[int] = [0]
        # A prefix hit's open block of a compressed group, (group, entry): copied on write
        # when the request is next allocated for; the copies its next step makes first
        # (source, destination block), common/engine/group_tables.py.
        self.open_shared: list[tuple[int, int]] = []
        self.block_copies: list[tuple[int, int]] = []
        self.block_hashes: list[BlockHash] = []
        self.num_registered_blocks = 0
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prompt tokens served from the prefix cache
        self.num_replayed_tokens = 0  # cached but recomputed: a window's blocks were lost
        # prompt logprobs by position, gathered over the prefill's chunks (prompt_logprobs.py)
        self.prompt_scores: dict[int, TokenLogprobs] = {}
        self.finish_reason: str | None = None
        # Speculative decoding: draft slots the scheduler reserved this step after the last
        # token, and how many leading positions the draft model's own KV holds.
        self.num_drafts = 0
        self.num_draft_computed = 0

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_ids_between(self, start: int, stop: int) -> list[int]:
        """``all_token_ids[start:stop]`` without building the whole list (a decode step
        wants one token of a context that may be 100k long)."""
        num_prompt = len(self.prompt_token_ids)
        if start >= num_prompt:
            return self.output_token_ids[start - num_prompt : stop - num_prompt]
        if stop <= num_prompt:
            return self.prompt_token_ids[start:stop]
        return self.prompt_token_ids[start:] + self.output_token_ids[: stop - num_prompt]

    @property
    def block_ids(self) -> list[int]:
        return self.tables[0]

    @block_ids.setter
    def block_ids(self, value: list[int]) -> None:
        self.tables[0] = value

    @property
    def num_dropped_blocks(self) -> int:
        return self.dropped[0]

    @num_dropped_blocks.setter
    def num_dropped_blocks(self, value: int) -> None:
        self.dropped[0] = value

    @property
    def held_block_ids(self) -> list[int]:
        """The blocks this request references: each group's table without its dropped
        entries, group after group (the order a KVHandle lists them in)."""
        return [b for t, d in zip(self.tables, self.dropped, strict=True) for b in t[d:]]

    def take_block_copies(self) -> list[tuple[int, int]]:
        copies, self.block_copies = self.block_copies, []
        return copies

    def held_of_group(self, group: int) -> list[int]:
        return self.tables[group][self.dropped[group] :]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_pending_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def has_pending_token(self) -> bool:
        """Its newest token is still on the device (common/engine/async_steps.py)."""
        return self.output_token_ids[-1:] == [PENDING_TOKEN]

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens}, blocks={len(self.block_ids)})"
        )
