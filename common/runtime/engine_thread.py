"""The bridge between a service's asyncio loop and its engine thread.

Model steps and NIXL calls block, so each service runs them in one engine thread (NIXL
agents are not thread-safe: one thread owns the agent). The loop hands typed commands
(common/runtime/engine_commands.py) over a thread-safe queue; the thread gets a narrow
``EngineContext`` (config, ids, metrics, the callables that answer), never the service,
and hands results back with ``call_soon_threadsafe``. State crosses the two threads only
as those messages, or as snapshots the thread replaces whole (an attribute assignment).
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import structlog

from pdserve.common.engine.host_malloc import keep_freed_buffers
from pdserve.common.errors import FatalError
from pdserve.common.runtime import protocol as p
from pdserve.common.runtime.boundary import Limits
from pdserve.common.runtime.engine_commands import Barrier, Command
from pdserve.common.runtime.fault_hooks import FaultHooks
from pdserve.common.runtime.metrics import Metrics
from pdserve.common.runtime.sd_notify import Watchdog

if TYPE_CHECKING:
    from pdserve.common.engine.host_tier import HostTier
    from pdserve.common.engine.sampling_params import SamplingParams
    from pdserve.common.engine.structured import GrammarTable
    from pdserve.common.runtime.service_config import DeploymentConfig

log = structlog.get_logger("pdserve.worker")  # the name operators' log queries know


def report_engine(metrics: Metrics, engine: Any, num_pending: int, preemptions_seen: int) -> int:
    """Set a service engine's pool and queue gauges and count new preemptions; returns the
    preemption total now seen (the scheduler counts in total, the metric in increments)."""
    sched = engine.scheduler
    metrics.set("pdserve:kv_blocks_free", engine.pool.num_free_blocks)
    metrics.set("pdserve:num_requests_running", len(sched.running))
    metrics.set("pdserve:num_requests_waiting", len(sched.waiting) + num_pending)
    if sched.num_preemptions > preemptions_seen:
        metrics.inc("pdserve:num_preemptions", sched.num_preemptions - preemptions_seen)
    abandoned = sched.num_abandoned_tokens - metrics.value("pdserve:abandoned_tokens")
    metrics.inc("pdserve:abandoned_tokens", max(0, abandoned))  # 0: declared
    replayed = sched.num_replayed_tokens - metrics.value("pdserve:prefix_cache_replayed_tokens")
    if replayed > 0:
        metrics.inc("pdserve:prefix_cache_replayed_tokens", replayed)
    if engine.pool.tier is not None:
        report_tier(metrics, engine.pool.tier)
    runner = getattr(engine, "runner", None)
    for kind in ("graph", "eager"):  # in-process runners count them (model_runner.py)
        total = getattr(runner, f"num_{kind}_steps", None)
        if total is not None:
            seen = metrics.value("pdserve:model_steps", kind=kind)
            metrics.inc("pdserve:model_steps", max(0, total - seen), kind=kind)
    return int(sched.num_preemptions)


def report_tier(metrics: Metrics, tier: HostTier) -> None:
    """The host tier's gauge and counters (common/engine/host_tier.py keeps totals)."""
    metrics.set("pdserve:kv_host_cache_blocks", tier.num_blocks)
    metrics.set("pdserve:kv_host_cache_blocks_total", tier.num_slots)  # Pongs tell the router
    totals = {
        "pdserve:kv_host_cache_hits": tier.num_hits,
        "pdserve:kv_host_cache_offload_bytes": tier.num_offloaded * tier.block_bytes,
        "pdserve:kv_host_cache_reload_bytes": tier.num_reloaded * tier.block_bytes,
        "pdserve:kv_host_cache_served": tier.num_served,
    }
    for name, total in totals.items():  # an increment of 0 shows the counter exists
        metrics.inc(name, max(0.0, total - metrics.value(name)))


@dataclass(frozen=True, kw_only=True)
class EngineContext:
    """What an engine thread knows of its service. ``reply`` runs on the service's loop
    (through ``EngineThread.post``): it sends to a router through the front ROUTER."""

    cfg: DeploymentConfig
    instance: int
    torch_threads: int
    metrics: Metrics
    reply: Callable[[bytes, p.Message], None]
    faults: FaultHooks = FaultHooks()


class EngineThread(threading.Thread):
    """Runs ``setup()`` once, then turns until stopped: each turn hands the commands that
    arrived since the last one to their handlers (``handlers``: command type -> method),
    then does one unit of work (``run_once``). When that reports nothing more pending,
    the thread waits up to ``idle_wait`` for the next command; while the engine is
    ``quiet`` (nothing in flight that only polling notices), that wait doubles each idle
    turn up to ``idle_wait_max``, so an idle service does not wake 200 times a second (a
    command still ends the wait at once). Every turn kicks the systemd watchdog (when the
    service set one): a model step that hangs stops the pings.
    """

    idle_wait = 0.005
    idle_wait_max = 0.05

    def __init__(self, ctx: EngineContext, loop: asyncio.AbstractEventLoop, name: str) -> None:
        super().__init__(name=name, daemon=True)
        if ctx.cfg.device == "cpu":
            # before this thread first allocates: glibc would give it an arena of its own,
            # which the engine's step buffers do not fit (common/engine/host_malloc.py)
            keep_freed_buffers()
        self.ctx = ctx
        self.loop = loop
        self.inbox: queue.SimpleQueue[Command | None] = queue.SimpleQueue()
        self.ready = threading.Event()
        self.failed: BaseException | None = None
        self._stop_event = threading.Event()
        self.watchdog: Watchdog | None = None
        # Called on the service's loop when a turn raised: the engine cannot go on.
        self.on_fatal: Callable[[BaseException], None] | None = None
        self.handlers: dict[type[Command], Callable[[Any], None]] = {Barrier: self._on_barrier}
        # What the engine accepts, set by ``setup``: the service checks messages against it.
        self.limits: Limits | None = None
        # Requests waiting for their grammar's compile (structured.py), out of the engine:
        # request id -> (command, its sampling, deadline: None while xgrammar loads). Handled
        # again once it is ready.
        self._parked: dict[str, tuple[Command, SamplingParams, float | None]] = {}
        self._resuming: Command | None = None
        # Replies of the turn under way (``reply``); None outside ``run``'s turns, where
        # each reply is posted at once (tests turn the thread by hand).
        self._outbox: list[tuple[bytes, p.Message]] | None = None

    def submit(self, command: Command) -> None:
        self.inbox.put(command)

    def stop(self) -> None:
        self._stop_event.set()
        self.inbox.put(None)

    def post(self, callback: Callable[..., Any], *args: Any) -> None:
        """Run ``callback(*args)`` on the service's loop (after the replies held so far)."""
        if self._outbox:
            self._flush()
        if not self.loop.is_closed():
            self.loop.call_soon_threadsafe(callback, *args)

    def reply(self, identity: bytes, msg: p.Message) -> None:
        """Send ``msg`` to the router ``identity`` (from the service's loop). While the
        thread turns (``run``), a turn's replies go to the loop together when it ends:
        one wake-up of the loop for a step's tokens, not one per token (#49)."""
        if self._outbox is not None:
            self._outbox.append((identity, msg))
            return
        self.post(self.ctx.reply, identity, msg)

    def _flush(self) -> None:
        """Hand the replies held this turn to the loop, in order."""
        if self._outbox:
            held, self._outbox = self._outbox, []
            self.post(self._send_replies, held)

    def _send_replies(self, held: list[tuple[bytes, p.Message]]) -> None:
        for identity, msg in held:  # on the loop; one failed send never stops the rest
            try:
                self.ctx.reply(identity, msg)
            except Exception:
                log.exception("reply_failed", worker=self.name, message_type=type(msg).__name__)

    def setup(self) -> None:  # pragma: no cover - overridden
        pass

    def run_once(self) -> bool:  # pragma: no cover - overridden
        """One unit of work; True when there is more work pending."""
        return False

    def quiet(self) -> bool:
        """Nothing in flight that a turn must poll for (blocks held for a peer, pulls):
        the idle wait may grow. False keeps it at ``idle_wait``."""
        return False

    def teardown(self) -> None:
        pass

    def _on_barrier(self, cmd: Barrier) -> None:
        cmd.done.set()

    # -- grammars compiled off this thread --------------------------------------------------

    def grammar_table(self) -> GrammarTable | None:
        """The engine's grammars (None: no engine yet, or no structured output)."""
        engine = getattr(self, "engine", None)
        sampler = getattr(engine, "sampler", None)
        return getattr(sampler, "grammars", None)

    def grammar_ready(self, command: Command, request_id: str, sampling: SamplingParams) -> bool:
        """Whether ``command`` (a new request) may go to the engine now. A structured
        request whose grammar is not compiled yet waits out of the engine (no batch slot,
        no blocks) while a worker compiles it: False, and the command is handled again
        once the grammar is ready, or once ``grammar_compile_timeout_seconds`` passed
        (then the engine refuses it, naming that budget)."""
        grammars = self.grammar_table()
        if sampling.structured is None or grammars is None or command is self._resuming:
            return True
        if grammars.request(sampling.structured, self._wake):
            return True
        self._parked[request_id] = (command, sampling, self._grammar_deadline(grammars))
        return False

    def _grammar_deadline(self, grammars: GrammarTable) -> float | None:
        """None while xgrammar is still being loaded (the first structured request's
        import, ~10 s, is not its grammar's compile): the budget starts once it is."""
        if not grammars.loaded:
            return None
        return time.monotonic() + self.ctx.cfg.grammar_compile_timeout_seconds

    def unpark(self, request_id: str) -> Command | None:
        """The command of a request still waiting for its grammar, forgotten (aborted)."""
        entry = self._parked.pop(request_id, None)
        return entry[0] if entry is not None else None

    def _wake(self) -> None:
        self.inbox.put(None)  # ends the turn's wait; None is no command

    def _resume_parked(self) -> None:
        grammars = self.grammar_table()
        if not self._parked or grammars is None:
            return
        now = time.monotonic()
        for request_id, (command, sampling, deadline) in list(self._parked.items()):
            assert sampling.structured is not None
            if not grammars.request(sampling.structured):
                if deadline is None:
                    self._parked[request_id] = (command, sampling, self._grammar_deadline(grammars))
                    continue
                if now < deadline:
                    continue
                seconds = self.ctx.cfg.grammar_compile_timeout_seconds
                grammars.expire(sampling.structured, f"the {sampling.structured.kind} "
                                f"constraint did not compile within {seconds:g} s "
                                "(grammar_compile_timeout_seconds); simplify it")  # fmt: skip
            del self._parked[request_id]
            self._resuming = command
            try:
                self._handle(command)
            finally:
                self._resuming = None

    def run(self) -> None:
        try:
            self.setup()
        except BaseException as exc:  # reported to the service, which exits with it
            self.failed = exc
            log.error(
                "worker_setup_failed",
                worker=self.name,
                error=str(exc),
                traceback=traceback.format_exc(),
            )
            self.ready.set()
            return
        self.ready.set()
        busy = False
        wait = self.idle_wait
        self._outbox = []
        try:
            while not self._stop_event.is_set():
                if self.watchdog is not None:
                    self.watchdog.kick()
                commands = self._drain(None if busy else wait)
                if self._stop_event.is_set():
                    break
                self._resume_parked()
                for command in commands:
                    self._handle(command)
                busy = self.run_once()
                self._flush()
                idle = not (commands or busy or self._parked) and self.quiet()
                wait = min(2 * wait, self.idle_wait_max) if idle else self.idle_wait
        except Exception as exc:  # noqa: BLE001 - a dead engine thread must not look alive
            self.failed = exc
            log.error(
                "worker_failed",
                worker=self.name,
                error=str(exc),
                traceback=traceback.format_exc(),
            )
            if self.on_fatal is not None:
                self.post(self.on_fatal, exc)
        finally:
            self._flush()
            self._outbox = None
            self.teardown()

    def _handle(self, command: Command) -> None:
        """One command; an error in it fails its request, never the thread (a rank that
        died, ``FatalError``, still ends the engine)."""
        try:
            self.handlers[type(command)](command)
        except FatalError:
            raise
        except Exception as exc:
            log.exception("command_failed", worker=self.name, command=type(command).__name__)
            self.ctx.metrics.inc("pdserve:bad_messages")
            self.command_failed(command, exc)

    def command_failed(self, command: Command, exc: Exception) -> None:
        """Answer the request of a command whose handler raised (its state dropped)."""
        identity = getattr(command, "identity", None)
        request = getattr(command, "request", None)
        if identity is None or request is None:
            return
        self.forget(request.request_id)
        self.reply(
            identity,
            p.Failed(
                request_id=request.request_id,
                trace_id=request.trace_id,
                reason="bad_request",
                message=f"the request could not be handled: {exc}",
            ),
        )

    def forget(self, request_id: str) -> None:
        """Drop what the thread holds of a request that failed in a command."""

    def _drain(self, timeout: float | None) -> list[Command]:
        """The commands waiting; none waiting, the first to come within ``timeout``
        (None: do not wait)."""
        commands: list[Command | None] = []
        if timeout is not None:
            try:
                commands.append(self.inbox.get(timeout=timeout))
            except queue.Empty:
                return []
        while True:
            try:
                commands.append(self.inbox.get_nowait())
            except queue.Empty:
                break
        return [c for c in commands if c is not None]
