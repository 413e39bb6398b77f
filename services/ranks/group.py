"""RankGroup: a coordinator's handle on the TP x PCP rank processes of one instance, of
either role (services/ranks/process.py): prefill ranks serve their KV with a producer
agent, decode ranks read theirs with a consumer agent.

It is the engine's StepRunner: a step plan is broadcast to every rank, rank 0's logits
come back. Blocks are allocated once, by the coordinator's scheduler, so every rank uses
the same block ids. Ranks also send events the coordinator did not ask for (a producer's
received releases, a consumer's finished pulls); they are kept in arrival order and
handed out by :meth:`take_events`.

Pipe messages are the Structs of services/ranks/messages.py (msgpack, never pickle).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time
from typing import Any, TypeVar

import msgspec
import numpy as np
import torch

from pdserve.common.engine.config import EngineConfig
from pdserve.common.engine.kv_layout import KVLayout
from pdserve.common.engine.prompt_logprobs import PromptScores
from pdserve.common.engine.sampling_params import TokenLogprobs
from pdserve.common.engine.step_plan import StepPlan
from pdserve.common.errors import FatalError
from pdserve.common.runtime import protocol as p
from pdserve.common.runtime.ports import free_port
from pdserve.common.runtime.protocol import HandshakeReply
from pdserve.services.ranks import messages as m

START_TIMEOUT = 600.0
STEP_TIMEOUT = 600.0

R = TypeVar("R", bound=m.RankMessage)


# What every rank imports before it loads a shard (torch, the model code, NIXL's UCX
# plugin: common/transfer/nixl_libs.py): the rank processes fork from a server that
# imported these once (multiprocessing's forkserver), instead of each importing them again
# (~1.3 s of CPU a rank, and ~0.4 s for its first NIXL agent). The server is started
# fresh by this process and holds no threads, CUDA context, sockets or agents. It lives
# while any rank it forked does, so each rank watches this process's pid instead
# (common/runtime/parent_watch.py); the server ends after its last rank.
RANK_PRELOAD = [
    "torch",
    "torch.distributed",
    "pdserve.common.transfer.nixl_libs",
    "pdserve.services.ranks.process",
    "pdserve.common.engine.model_runner",
    "pdserve.common.model.checkpoint.files",
    "pdserve.common.parallel.context",
]


def rank_context() -> Any:
    """The multiprocessing context rank processes start from (see RANK_PRELOAD)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(RANK_PRELOAD)
    return ctx


class RankFailed(FatalError):
    """A rank process died or reported an error: the instance cannot go on."""


class RankGroup:
    """Built by ``RankGroup.prefill`` or ``RankGroup.decode``."""

    def __init__(
        self,
        role: str,
        config: EngineConfig,
        name: str,
        *,
        tp: int = 1,
        pcp: int = 1,
        agent: dict[str, Any] | None = None,
    ) -> None:
        from pdserve.services.ranks.process import rank_main

        ctx = rank_context()
        dist_addr = f"tcp://127.0.0.1:{free_port()}"
        self.tp, self.pcp = tp, pcp
        self.num_ranks = tp * pcp
        self.conns: list[Any] = []
        self.procs: list[Any] = []
        self._events: list[tuple[int, m.Event]] = []
        setup = msgspec.json.encode({"config": config, "agent": agent or {}})
        for rank in range(self.num_ranks):
            parent, child = ctx.Pipe()
            proc = ctx.Process(
                target=rank_main,
                name=f"pdserve-{name}-rank{rank}",  # its command line (rank_main)
                daemon=True,
                args=(role, rank, tp, pcp, dist_addr, setup, child, os.getpid()),
            )
            proc.start()
            self.conns.append(parent)
            self.procs.append(proc)
        self.handshake_replies: list[HandshakeReply] = []
        layouts = []
        for rank in range(self.num_ranks):
            ready = self._expect(rank, m.Ready, START_TIMEOUT)
            if ready.handshake is not None:
                self.handshake_replies.append(ready.handshake)
            layouts.append(ready.layout)
        self.layout: KVLayout = layouts[0]
        self.last_prompt_logprobs: PromptScores = {}  # the last step's, of every rank

    @classmethod
    def prefill(
        cls,
        config: EngineConfig,
        pcp: int,
        engine_id: str,
        epoch: int,
        tp: int = 1,
        backend: str = "nixl",
    ) -> RankGroup:
        """A prefill instance's TP x PCP ranks: each rank's producer (of transfer backend
        ``backend``) serves its heads of every block (a full replica of them under PCP) to
        decode instances."""
        # engine_id: prefill-N, its name; backend: common/transfer/registry.py
        agent = {"engine_id": engine_id, "epoch": epoch, "backend": backend}
        return cls("prefill", config, engine_id, tp=tp, pcp=pcp, agent=agent)

    @classmethod
    def decode(
        cls, config: EngineConfig, tp: int, agent_name: str, name: str = "", backend: str = "nixl"
    ) -> RankGroup:
        """A decode instance's TP ranks: each rank's consumer (of transfer backend
        ``backend``) reads its heads from the producers (services/decode/pullers.py, RankPuller). ``name``: the instance's
        (decode-N; default: the agent's)."""
        agent = {"name": agent_name, "backend": backend}
        return cls("decode", config, name or agent_name, tp=tp, agent=agent)

    def execute(self, plan: StepPlan) -> torch.Tensor:
        payload = m.encode(m.Step(plan))  # encoded once for every rank
        for conn in self.conns:
            conn.send_bytes(payload)
        logits = torch.empty(0)
        # Each rank's prompt logprobs are of its own positions (PCP); TP ranks repeat theirs.
        by_position: dict[str, dict[int, TokenLogprobs]] = {}
        for rank in range(self.num_ranks):
            reply: m.Logits | m.StepDone
            if rank == 0:
                reply = out = self._expect(rank, m.Logits, STEP_TIMEOUT)
                buf = np.frombuffer(out.data, dtype=np.float32).reshape(out.shape)
                logits = torch.from_numpy(buf.copy())
            else:
                reply = self._expect(rank, m.StepDone, STEP_TIMEOUT)
            for request_id, entries in reply.prompt_logprobs.items():
                by_position.setdefault(request_id, {}).update(entries)
        self.last_prompt_logprobs = {rid: sorted(d.items()) for rid, d in by_position.items()}
        return logits

    def send(self, rank: int, command: m.ToRank) -> None:
        self.conns[rank].send_bytes(m.encode(command))

    def call(
        self, rank: int, command: m.ToRank, reply: type[R], timeout: float = STEP_TIMEOUT
    ) -> R:
        """Send ``command`` to ``rank`` and wait for its ``reply``."""
        self.send(rank, command)
        return self._expect(rank, reply, timeout)

    def take_events(self) -> list[tuple[int, m.Event]]:
        """(rank, event) pairs received since the last call, without blocking."""
        for rank, conn in enumerate(self.conns):
            while conn.poll(0):
                self._take(rank, self._recv(rank))
        out, self._events = self._events, []
        return out

    def poll_releases(self) -> list[tuple[int, p.Release]]:
        """(rank, release) for each release a prefill rank's agent received: the lease
        table frees a request only when every rank has reported it."""
        return [
            (rank, release)
            for rank, event in self.take_events()
            if isinstance(event, m.Released)
            for release in event.releases
        ]

    def cache_blocks(self, rank: int, block_ids: list[int]) -> np.ndarray:
        """Rank ``rank``'s copy of ``block_ids`` as float32 (tests compare replicas)."""
        blocks = self.call(rank, m.ReadBlocks(block_ids), m.BlockBytes)
        return np.frombuffer(blocks.data, dtype=np.float32)

    def check_alive(self) -> None:
        for rank, proc in enumerate(self.procs):
            if not proc.is_alive():
                raise RankFailed(f"rank {rank} died (exit code {proc.exitcode})")

    def close(self) -> None:
        for conn in self.conns:
            try:
                conn.send_bytes(m.encode(m.Stop()))
            except OSError:
                pass
        for proc in self.procs:
            proc.join(10)
            if proc.is_alive():
                proc.kill()

    def _recv(self, rank: int) -> m.FromRank:
        try:
            return m.from_rank.decode(self.conns[rank].recv_bytes())
        except EOFError as exc:
            raise RankFailed(
                f"rank {rank} closed its pipe (exit code {self.procs[rank].exitcode})"
            ) from exc
        except (msgspec.DecodeError, RecursionError) as exc:  # the pipe is out of step: fatal
            raise RankFailed(f"rank {rank} sent an undecodable pipe message: {exc}") from exc

    def _expect(self, rank: int, kind: type[R], timeout: float) -> R:
        """The next message of ``kind`` from ``rank``; events met on the way are kept."""
        conn, deadline = self.conns[rank], time.monotonic() + timeout
        while True:
            if not self.procs[rank].is_alive() and not conn.poll(0):
                raise RankFailed(f"rank {rank} died (exit code {self.procs[rank].exitcode})")
            if not conn.poll(min(1.0, max(0.0, deadline - time.monotonic()))):
                if time.monotonic() >= deadline:
                    raise RankFailed(f"rank {rank} gave no {kind.__name__} within {timeout:.0f} s")
                continue
            msg = self._recv(rank)
            if isinstance(msg, kind):
                return msg
            self._take(rank, msg)

    def _take(self, rank: int, msg: m.FromRank) -> None:
        if isinstance(msg, m.EVENTS):
            self._events.append((rank, msg))
        elif isinstance(msg, m.RankError):
            # Often a collective that lost a dead peer: name the dead rank if there is one
            # (it may take a moment to be reaped).
            for _ in range(50):
                self.check_alive()
                time.sleep(0.01)
            raise RankFailed(msg.message)
        else:
            raise RankFailed(f"rank {rank} sent an unexpected {type(msg).__name__}")
