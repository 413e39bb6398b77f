"""DecodeEngine: the engine admitting requests whose prompt KV arrives from a producer.

Such a request waits in the scheduler (``WAITING_FOR_REMOTE_KV``) from the moment decode
accepts it: the engine thread asks for the blocks its pull lands in (``reserve_remote``),
then reports the pull done (``pulled``) or failed (``pull_failed``); ``abort`` ends it in
any of these states. The scheduler owns the blocks throughout: the thread never touches the
pool.
"""

from __future__ import annotations

from collections.abc import Sequence

from pdserve.common.engine.llm_engine import LLMEngine
from pdserve.common.engine.outputs import RequestOutput
from pdserve.common.engine.request import RemoteKV, Request, Status
from pdserve.common.engine.sampling import SamplingParams
from pdserve.common.errors import RequestError


class DecodeEngine(LLMEngine):
    def add_remote(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        sampling: SamplingParams,
        remote: RemoteKV,
        client: str = "",
        priority: int = 0,
    ) -> None:
        """Accept a request whose prompt was prefilled elsewhere (``remote``: what its KV
        handle says); it waits for its pull. Raises RequestError for a request this engine
        cannot serve."""
        req = self._new_request(request_id, prompt_token_ids, sampling, client, priority)
        req.remote = remote
        self._track(req)

    def reserve_remote(self, request_id: str) -> list[int] | None:
        """The local blocks the request's pull lands in, reserved now, in the order of its
        handle's block ids (each group's kept entries, group after group); None while they
        are not free. Raises RequestError when the handle's groups do not fit this cache."""
        req = self._waiting_for_kv(request_id)
        assert req.remote is not None
        self.check_groups(len(req.remote.first_blocks))
        if not self.scheduler.reserve_remote(req):
            return None
        return req.held_block_ids

    def pulled(self, request_id: str) -> RequestOutput:
        """The pull is done: decoding starts; the output of the producer's first token."""
        req = self._waiting_for_kv(request_id)
        self.scheduler.remote_kv_arrived(req)
        return self._first_output(req)

    def pull_failed(self, request_id: str, recompute: bool) -> RequestOutput | None:
        """The pull failed or could not start: its blocks come back. ``recompute``
        (``kv_load_failure_policy = "recompute"``): the prompt is computed here and the
        first token's output returned; else the request ends (None)."""
        req = self._waiting_for_kv(request_id)
        self.scheduler.remote_kv_failed(req, recompute)
        if not recompute:
            del self._requests[request_id]
            return None
        return self._first_output(req)

    def _waiting_for_kv(self, request_id: str) -> Request:
        req = self._requests[request_id][0]
        if req.status is not Status.WAITING_FOR_REMOTE_KV:
            raise RuntimeError(f"request {request_id!r} is not waiting for its KV")
        return req

    def _first_output(self, req: Request) -> RequestOutput:
        remote = req.remote
        assert remote is not None
        # admitted now: it counts as the latest arrival (who is preempted first)
        req.arrival_order = next(self._arrivals)
        req.num_cached_tokens = remote.num_cached_tokens
        req.output_token_ids.append(remote.first_token)
        return self._emit(req, remote.first_token)

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
