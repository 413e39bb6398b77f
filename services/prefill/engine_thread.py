"""The prefill engine thread: prefills, pins KV under leases, frees on release/expiry."""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import structlog

from pdserve.common.errors import FatalError, PdserveError
from pdserve.common.runtime import protocol as p
from pdserve.common.runtime.boundary import Limits
from pdserve.common.runtime.engine_commands import Abort, Heartbeat, Prefill, SideRelease
from pdserve.common.runtime.engine_thread import EngineContext, EngineThread, report_engine
from pdserve.services.prefill.lease_table import Freed, LeaseTable

if TYPE_CHECKING:
    from pdserve.common.transfer.backend import KVProducerRole
    from pdserve.services.prefill.prefill_engine import Prefilled, PrefillEngine
    from pdserve.services.ranks.group import RankGroup

log = structlog.get_logger("pdserve.prefill")


@dataclass(frozen=True, kw_only=True)
class PrefillContext(EngineContext):
    engine_id: str
    epoch: int  # this life's: handles of another are refused
    side_channel: str  # where decode instances handshake and release
    # Runs on the loop once the agents exist: the handshake replies the side channel
    # serves, one per rank.
    publish_handshakes: Callable[[list[p.HandshakeReply]], None]


class PrefillEngineThread(EngineThread):
    def __init__(self, ctx: PrefillContext, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(ctx, loop, name=f"prefill-{ctx.instance}")
        self.ctx: PrefillContext = ctx
        self.handlers.update({
            Prefill: self._on_prefill,
            Abort: self._on_abort,
            Heartbeat: self._on_heartbeat,
            SideRelease: self._on_side_release,
        })  # fmt: skip
        self.num_leases = 0  # a snapshot for the service's drain, replaced every turn
        self.peers: dict[str, tuple[bytes, str]] = {}  # request id -> (router identity, trace id)
        self.scheduled_at: dict[str, float] = {}  # request id -> wall time its prefill began
        self._num_preemptions = 0

    def setup(self) -> None:
        import torch

        from pdserve.services.prefill.prefill_engine import PrefillEngine

        ctx = self.ctx
        cfg = ctx.cfg
        torch.set_num_threads(ctx.torch_threads)
        engine_cfg = cfg.engine_for("prefill")
        self.ranks: RankGroup | None = None
        self.producer: KVProducerRole | None = None
        if cfg.pcp * cfg.prefill_tp > 1:
            from pdserve.services.ranks.group import RankGroup

            self.ranks = RankGroup.prefill(
                engine_cfg,
                cfg.pcp,
                ctx.engine_id,
                ctx.epoch,
                tp=cfg.prefill_tp,
                backend=cfg.kv_transfer_backend,
            )
            self.engine: PrefillEngine = PrefillEngine(engine_cfg, runner=self.ranks)
            replies = self.ranks.handshake_replies
        else:
            from pdserve.common.engine.model_runner import ModelRunner
            from pdserve.common.engine.tier_buffer import TierBuffer
            from pdserve.common.transfer.backend import ProducerSpec
            from pdserve.common.transfer.registry import transfer_backend

            self.engine = PrefillEngine(engine_cfg)
            runner = self.engine.runner
            assert isinstance(runner, ModelRunner)  # in process: no rank group
            tier = self.engine.pool.tier
            buffer = None if tier is None else tier.mover
            assert buffer is None or isinstance(buffer, TierBuffer)
            self.producer = transfer_backend(cfg.kv_transfer_backend).producer(
                ProducerSpec(
                    engine_id=ctx.engine_id,
                    epoch=ctx.epoch,
                    agent_name=f"{ctx.engine_id}-e{ctx.epoch}-r0",
                    kv_cache=runner.kv_cache,
                    layout=runner.layout,
                    compat=runner.kv_compat(),
                    host_cache=None if buffer is None else buffer.logical,
                    host_layout=None if buffer is None else buffer.layout,
                )
            )
            # decode reads tier blocks from the tier (their device blocks free at publish), or
            # from this device, where the step brought them up (kv_host_tier_serve)
            self.engine.scheduler.publish_host_tier = (
                buffer is not None and engine_cfg.serves_host_tier
            )
            replies = [self.producer.handshake_reply]
        self.post(ctx.publish_handshakes, list(replies))
        self.replicas = [
            p.Replica(
                agent_name=r.agent_name,
                side_channel=ctx.side_channel,
                tp_rank=r.tp_rank,
                pcp_rank=r.pcp_rank,
            )
            for r in replies
        ]
        self.leases = LeaseTable(num_ranks=len(replies), lease_seconds=cfg.lease_seconds)
        # what a handle says of compressed groups (none: the field stays empty)
        rates = [g.rate for g in self.engine.kv_groups]
        self._group_rates = rates if any(r > 1 for r in rates) else []
        self.metrics = ctx.metrics
        self.limits = Limits(
            vocab_size=self.engine.model_config.vocab_size,
            max_model_len=self.engine.max_model_len,
            num_ranks=len(replies),
        )
        self.metrics.set("pdserve:kv_blocks_total", self.engine.pool.num_blocks)
        self.metrics.declare(
            "pdserve:num_preemptions",
            "pdserve:bad_messages",
            "pdserve:kv_forged_messages",
            "pdserve:prefix_cache_replayed_tokens",
        )
        for rank in range(self.leases.num_ranks):
            self.metrics.declare(
                "pdserve:kv_replica_releases", "pdserve:kv_expired_requests", rank=rank
            )

    def teardown(self) -> None:
        if hasattr(self, "leases"):
            for freed in self.leases.drop_all():
                self._free(freed)
        if self.producer is not None:
            self.producer.close()
        if self.ranks is not None:
            self.ranks.close()
        if hasattr(self, "engine"):
            self.engine.close()  # the host tier's blocks and memory

    def run_once(self) -> bool:
        for rank, release in self._releases():
            self._on_release(release, rank)
        for freed in self.leases.expire(time.time()):
            self._free(freed)
        if self.engine.has_unfinished:
            self._step()
        self._update_gauges()
        self.num_leases = len(self.leases)
        # Busy only while steps compute: requests waiting for pinned blocks to come back
        # must not spin the loop.
        return self.engine.has_unfinished and self.engine.last_step_tokens > 0

    def quiet(self) -> bool:
        # Releases come only for leased blocks, and expiry only ends leases.
        return not self.engine.has_unfinished and len(self.leases) == 0

    def _releases(self) -> list[tuple[int, p.Release]]:
        """Releases received by every rank's transfer backend, each with its rank."""
        if self.ranks is not None:
            return self.ranks.poll_releases()
        assert self.producer is not None
        return [(0, r) for r in self.producer.poll_releases()]

    # -- commands from the loop -----------------------------------------------------------

    def _on_prefill(self, cmd: Prefill) -> None:
        identity, req = cmd.identity, cmd.request
        if not self.grammar_ready(cmd, req.request_id, req.sampling):
            return  # handled again once its grammar is compiled (or its budget passed)
        try:
            self.engine.add_request(req.request_id, req.prompt_token_ids, req.sampling,
                                    client=req.client, priority=req.priority)  # fmt: skip
        except PdserveError as exc:
            self._fail(identity, req.request_id, req.trace_id, "bad_request", str(exc))
            return
        self.peers[req.request_id] = (identity, req.trace_id)

    def forget(self, request_id: str) -> None:
        self.peers.pop(request_id, None)
        self.engine.abort(request_id)

    def _on_abort(self, cmd: Abort) -> None:
        request_id = cmd.request_id
        if self.unpark(request_id) is not None:  # it never reached the engine
            return
        if self.engine.abort(request_id) is not None:
            self.peers.pop(request_id, None)
            return
        if request_id in self.leases:  # decode will never pull it: free at once
            for rank in range(self.leases.num_ranks):
                freed = self.leases.release(request_id, rank)
                if freed is not None:
                    self._free(freed)

    def _on_heartbeat(self, cmd: Heartbeat) -> None:
        beat = cmd.beat
        if self._is_ours(beat.engine_id, beat.epoch):
            refused = [
                rid
                for rid in self.leases.extend(beat.request_ids, time.time(), beat.tokens)
                if rid in self.leases
            ]
            if refused:  # held here, but named without the handle's token
                self.metrics.inc("pdserve:kv_forged_messages", len(refused))
                log.warning("heartbeat_refused", request_ids=refused[:8], num=len(refused))

    def _on_side_release(self, cmd: SideRelease) -> None:
        self._on_release(cmd.release, cmd.release.rank)

    def _on_release(self, release: p.Release, rank: int) -> None:
        if not self._is_ours(release.engine_id, release.epoch):
            log.warning("stale_release", request_id=release.request_id, epoch=release.epoch)
            return
        if not self.leases.owns(release.request_id, release.token):
            self.metrics.inc("pdserve:kv_forged_messages")
            log.warning("release_refused", request_id=release.request_id, rank=rank,
                        why="the release does not carry the handle's token")  # fmt: skip
            return
        self.metrics.inc("pdserve:kv_replica_releases", rank=rank)
        freed = self.leases.release(release.request_id, rank, release.token)
        if freed is not None:
            self._free(freed)

    def _is_ours(self, engine_id: str, epoch: int) -> bool:
        return engine_id == self.ctx.engine_id and epoch == self.ctx.epoch

    # -- engine ---------------------------------------------------------------------------

    def _step(self) -> None:
        started = time.time()
        try:
            results = self.engine.step()
        except FatalError:
            raise  # a rank died: the service fails what it holds and exits
        except Exception as exc:
            log.exception("prefill_step_failed")
            for rid in list(self.peers):
                self.engine.abort(rid)
                identity, trace = self.peers.pop(rid)
                self._fail(identity, rid, trace, "internal", f"prefill step failed: {exc}")
            return
        self._mark_scheduled(started)
        for rid, why in self.engine.take_failures():  # this request alone
            identity, trace = self.peers.pop(rid)
            self._fail(identity, rid, trace, "internal", why)
        for done in results:
            self._publish(done)

    def _mark_scheduled(self, started: float) -> None:
        """A request's prefill began with the first step that left it out of the waiting
        queue (TTFT parts, common/runtime/ttft.py)."""
        if self.engine.last_step_tokens == 0:
            return
        waiting = {req.request_id for req in self.engine.scheduler.waiting}
        for rid in self.peers:
            if rid not in waiting:
                self.scheduled_at.setdefault(rid, started)
        if len(self.scheduled_at) > len(self.peers):  # aborted or failed requests
            self.scheduled_at = {
                rid: t for rid, t in self.scheduled_at.items() if rid in self.peers
            }

    def _publish(self, done: Prefilled) -> None:
        identity, trace = self.peers.pop(done.request_id)
        token = secrets.token_hex(16)
        deadline = self.leases.add(done.request_id, trace, done.block_ids, time.time(), token)
        handle = p.KVHandle(
            engine_id=self.ctx.engine_id,
            epoch=self.ctx.epoch,
            layout=self.engine.runner.layout,
            block_ids=done.block_ids,
            host_slots=done.host_slots,
            first_block=done.first_block,
            group_first_blocks=done.group_first_blocks,
            group_rates=self._group_rates,
            num_tokens=done.num_tokens,
            replicas=self.replicas,
            lease_deadline=deadline,
            token=token,
        )
        msg = p.PrefillDone(
            request_id=done.request_id,
            trace_id=trace,
            first_token=done.first_token,
            num_cached_tokens=done.num_cached_tokens,
            handle=handle,
            first_logprobs=done.logprobs[0] if done.logprobs else None,
            prompt_logprobs=done.prompt_logprobs,
            timings={
                "prefill_scheduled": self.scheduled_at.pop(done.request_id, time.time()),
                "prefill_done": time.time(),
            },
        )
        self.reply(identity, msg)

    def _free(self, freed: Freed) -> None:
        if not self.engine.unpin(freed.request_id):
            log.error("kv_lease_without_pin", request_id=freed.request_id, trace_id=freed.trace_id)
        for rank in freed.expired_ranks:
            self.metrics.inc("pdserve:kv_expired_requests", rank=rank)
            log.warning(
                "kv_lease_expired", request_id=freed.request_id, trace_id=freed.trace_id, rank=rank
            )

    def _fail(
        self, identity: bytes, request_id: str, trace_id: str, reason: str, message: str
    ) -> None:
        self.reply(
            identity,
            p.Failed(request_id=request_id, trace_id=trace_id, reason=reason, message=message),
        )

    def _update_gauges(self) -> None:
        self._num_preemptions = report_engine(self.metrics, self.engine, 0, self._num_preemptions)
