"""The decode engine thread: pulls prompt KV (NIXL, or another transfer backend: common/transfer/
backend.py), releases producers, decodes.

A request with a KV handle moves through: waiting for the producer's handshake ->
waiting for local blocks -> pulling -> decoding. Its engine holds it from the start
(``WAITING_FOR_REMOTE_KV``, services/decode/decode_engine.py) and owns its blocks: this
thread asks for them and reports how the pull ended, it never frees a block itself. Every
producer replica is released exactly once per request, whether the pull worked, failed or
was aborted: the pulls' table (services/decode/pending.py, ``PendingPulls``) follows a
request until its pull ends, this thread then admits it or answers it. With decode TP > 1
the model and the pulls run in rank processes (services/decode/pullers.py).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass

import structlog

from pdserve.common.engine.outputs import RequestOutput
from pdserve.common.engine.request import RemoteKV
from pdserve.common.errors import FatalError, PdserveError
from pdserve.common.runtime import protocol as p
from pdserve.common.runtime.boundary import Limits
from pdserve.common.runtime.engine_commands import Abort, Connected, Decode, HandshakeFailed
from pdserve.common.runtime.engine_thread import EngineContext, EngineThread, report_engine
from pdserve.common.runtime.spec_metrics import SpecDecodeReporter
from pdserve.services.decode.pending import PendingByProducer, PendingPull, PendingPulls

log = structlog.get_logger("pdserve.decode")


@dataclass(frozen=True, kw_only=True)
class DecodeContext(EngineContext):
    # Runs on the loop: a message to a producer's side channel (a Release NIXL could not
    # deliver).
    send_side: Callable[[str, p.Message], None]


class DecodeEngineThread(EngineThread):
    def __init__(self, ctx: DecodeContext, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(ctx, loop, name=f"decode-{ctx.instance}")
        self.ctx: DecodeContext = ctx
        self.handlers.update({
            Decode: self._on_decode,
            Connected: self._on_connected,
            HandshakeFailed: self._on_handshake_failed,
            Abort: self._on_abort,
        })  # fmt: skip
        # What the service's heartbeats name, replaced whole every turn (a snapshot).
        self.pending_by_producer: PendingByProducer = {}
        # Producers a pull failed to reach (PendingPulls.unreachable), for the service's Pongs.
        self.unreachable_producers: list[str] = []
        self.peers: dict[str, tuple[bytes, str]] = {}  # request id -> (router identity, trace id)
        self.pulls: PendingPulls  # made by setup (open_pulls)
        self.spec_reporter: SpecDecodeReporter | None = None  # set up with a speculator
        self._num_preemptions = 0

    def setup(self) -> None:
        import torch

        from pdserve.services.decode.pullers import open_engine

        ctx = self.ctx
        torch.set_num_threads(ctx.torch_threads)
        engine_cfg = ctx.cfg.engine_for("decode")
        self.tp = ctx.cfg.decode_tp_of(ctx.instance)
        agent_name = f"decode-{ctx.instance}-{time.time_ns()}"
        self.engine, self.puller = open_engine(
            engine_cfg, self.tp, agent_name, f"decode-{ctx.instance}", ctx.cfg.kv_transfer_backend
        )
        self.metrics = ctx.metrics
        self.limits = Limits(
            vocab_size=self.engine.model_config.vocab_size,
            max_model_len=self.engine.max_model_len,
        )
        self.metrics.set("pdserve:kv_blocks_total", self.engine.pool.num_blocks)
        self.metrics.declare(
            "pdserve:kv_transfers",
            "pdserve:kv_transfer_bytes",
            "pdserve:kv_transfer_descriptors",
            "pdserve:kv_transfer_failures",
            "pdserve:kv_notification_failures",
            "pdserve:num_preemptions",
            "pdserve:prefix_cache_replayed_tokens",
            "pdserve:bad_messages",
        )
        if self.engine.speculator is not None:
            self.spec_reporter = SpecDecodeReporter(self.metrics, self.engine.speculator.stats)
        self.open_pulls()

    def open_pulls(self) -> None:
        """The pulls' table over the engine and puller ``setup`` opened (tests: fakes)."""
        self.pulls = PendingPulls(
            self.engine,
            self.puller,
            tp=self.tp,
            striped=self.ctx.cfg.pull_from == "striped",
            metrics=self.metrics,
            faults=self.ctx.faults,
            send_release=lambda address, release: self.post(self.ctx.send_side, address, release),
            ended=self._pull_ended,
        )

    def teardown(self) -> None:
        if hasattr(self, "puller"):
            self.puller.close()
        if hasattr(self, "engine"):
            self.engine.close()  # the host tier's blocks and memory

    def run_once(self) -> bool:
        self.pulls.advance()
        if self.engine.has_unfinished:
            self._step()
        self._update_gauges()
        self.pending_by_producer = self.pulls.by_producer()
        self.unreachable_producers = sorted(self.pulls.unreachable)
        computing = self.engine.has_unfinished and self.engine.last_step_tokens > 0
        return computing or self.pulls.is_pulling

    def quiet(self) -> bool:
        return not len(self.pulls) and not self.engine.has_unfinished

    # -- commands ---------------------------------------------------------------------------

    def _on_decode(self, cmd: Decode) -> None:
        identity, msg = cmd.identity, cmd.request
        rid, handle = msg.request_id, msg.handle
        if not self.grammar_ready(cmd, rid, msg.sampling):
            return  # handled again once its grammar is compiled (or its budget passed)
        try:
            if handle is None:  # colocated: this engine computes the prompt
                self.engine.add_request(rid, msg.prompt_token_ids, msg.sampling,
                                        client=msg.client, priority=msg.priority)  # fmt: skip
            else:
                assert msg.first_token is not None  # the boundary checked it
                remote = RemoteKV(
                    num_tokens=handle.num_tokens,
                    first_blocks=(handle.first_block, *handle.group_first_blocks),
                    first_token=msg.first_token,
                    num_cached_tokens=msg.num_cached_tokens,
                )
                self.engine.add_remote(rid, msg.prompt_token_ids, msg.sampling, remote,
                                       client=msg.client, priority=msg.priority)  # fmt: skip
        except PdserveError as exc:
            self._fail(identity, rid, msg.trace_id, "bad_request", str(exc))
            if handle is not None:
                self.pulls.release(handle, rid, msg.trace_id)
            return
        self.peers[rid] = (identity, msg.trace_id)
        if handle is not None:
            self.pulls.add(rid, PendingPull(identity, msg, handle))

    def forget(self, request_id: str) -> None:
        self.peers.pop(request_id, None)
        pp = self.pulls.get(request_id)
        if pp is not None and pp.pulling:
            pp.aborted = True  # its READs still land in its blocks: dropped when they end
            return
        self.pulls.pop(request_id)
        self.engine.abort(request_id)

    def _on_connected(self, cmd: Connected) -> None:
        self.pulls.connect(cmd.key, cmd.replies)

    def _on_handshake_failed(self, cmd: HandshakeFailed) -> None:
        self.pulls.handshake_failed(cmd.key, cmd.message)

    def _on_abort(self, cmd: Abort) -> None:
        request_id = cmd.request_id
        parked = self.unpark(request_id)  # still waiting for its grammar: nothing pulled
        if isinstance(parked, Decode):
            if parked.request.handle is not None:
                self.pulls.release(parked.request.handle, request_id, parked.request.trace_id)
            return
        pp = self.pulls.get(request_id)
        if pp is not None:
            pp.aborted = True  # an in-flight READ cannot be recalled: finish it, then drop
            if not pp.pulling:
                self._drop_pending(request_id, pp)
            return
        out = self.engine.abort(request_id)
        if out is not None:
            self._emit(out)

    # -- pulls' ends -----------------------------------------------------------------------

    def _pull_ended(self, rid: str, pp: PendingPull, error: str | None) -> None:
        """A pull that ended (``error``: why it failed), its replicas released: the request
        decodes, is recomputed, fails, or, aborted meanwhile, ends."""
        if pp.aborted:
            self.engine.abort(rid)
            self._finish_aborted(rid, pp)
            return
        if error is None:
            self._first_chunk(pp, self.engine.pulled(rid))
            return
        out = self.engine.pull_failed(rid, self.ctx.cfg.kv_load_failure_policy == "recompute")
        if out is not None:
            self._first_chunk(pp, out)
        else:
            self.peers.pop(rid, None)
            self._fail(
                pp.identity,
                rid,
                pp.msg.trace_id,
                "kv_transfer",
                f"KV transfer from {pp.handle.engine_id} failed: {error}",
            )

    def _first_chunk(self, pp: PendingPull, out: RequestOutput) -> None:
        """The producer's first token, as the request's first output."""
        if pp.msg.first_logprobs is not None:
            out.logprobs = [pp.msg.first_logprobs]
        self._emit(out, pp.marks)

    def _drop_pending(self, rid: str, pp: PendingPull) -> None:
        self.pulls.pop(rid)
        self.engine.abort(rid)
        self.pulls.release(pp.handle, rid, pp.msg.trace_id)
        self._finish_aborted(rid, pp)

    def _finish_aborted(self, rid: str, pp: PendingPull) -> None:
        if self.peers.pop(rid, None) is None:
            return  # answered already (a command of it failed: ``forget``)
        usage = p.Usage(prompt_tokens=len(pp.msg.prompt_token_ids), completion_tokens=0)
        self.reply(
            pp.identity,
            p.Finished(
                request_id=rid, trace_id=pp.msg.trace_id, finish_reason="abort", usage=usage
            ),
        )

    # -- decoding ---------------------------------------------------------------------------

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except FatalError:
            raise  # a rank died: the service fails what it holds and exits
        except Exception as exc:
            log.exception("decode_step_failed")
            for rid in [r for r in self.peers if r not in self.pulls]:  # pulls go on
                if self.engine.abort(rid) is not None:
                    identity, trace = self.peers.pop(rid)
                    self._fail(identity, rid, trace, "internal", f"decode step failed: {exc}")
            return
        for rid, why in self.engine.take_failures():  # this request alone
            identity, trace = self.peers.pop(rid)
            self._fail(identity, rid, trace, "internal", why)
        for out in outputs:
            self._emit(out)

    def _emit(self, out: RequestOutput, marks: dict[str, float] | None = None) -> None:
        """``marks``: the TTFT marks of a request's first output (common/runtime/ttft.py)."""
        peer = self.peers.get(out.request_id)
        if peer is None:
            return
        identity, trace = peer
        if out.new_token_ids or out.text:
            timings = {**marks, "first_chunk": time.time()} if marks else {}
            self.reply(
                identity,
                p.TokenChunk(
                    request_id=out.request_id,
                    trace_id=trace,
                    token_ids=out.new_token_ids,
                    text=out.text,
                    timings=timings,
                    logprobs=out.logprobs,
                    prompt_logprobs=out.prompt_logprobs,
                ),
            )
        if out.finished:
            del self.peers[out.request_id]
            usage = p.Usage(
                prompt_tokens=out.num_prompt_tokens,
                completion_tokens=out.num_output_tokens,
                cached_tokens=out.num_cached_tokens,
            )
            assert out.finish_reason is not None
            self.reply(
                identity,
                p.Finished(
                    request_id=out.request_id,
                    trace_id=trace,
                    finish_reason=out.finish_reason,
                    usage=usage,
                ),
            )

    def _fail(self, identity: bytes, rid: str, trace_id: str, reason: str, message: str) -> None:
        self.reply(
            identity,
            p.Failed(request_id=rid, trace_id=trace_id, reason=reason, message=message),
        )

    def _update_gauges(self) -> None:
        if self.spec_reporter is not None:
            self.spec_reporter.report()
        self._num_preemptions = report_engine(
            self.metrics, self.engine, len(self.pulls), self._num_preemptions
        )
