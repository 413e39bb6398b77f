"""RankGroup: the prefill coordinator's handle on its N context-parallel rank processes.

It is the engine's StepRunner: a step plan is broadcast to every rank, rank 0's logits
come back. Blocks are allocated once, by the coordinator's scheduler, so every replica
uses the same block ids. Releases the ranks' NIXL agents receive are reported back here,
one per rank, and the lease table frees a request only when all ranks have reported.
"""

from __future__ import annotations

import multiprocessing as mp
import time
from typing import Any

import msgspec
import numpy as np
import torch
from pdserve.common import protocol as p
from pdserve.common.config import EngineConfig
from pdserve.common.errors import PdserveError
from pdserve.common.kv_layout import KVLayout
from pdserve.common.ports import free_port
from pdserve.common.step_plan import StepPlan
from pdserve.services.prefill.rank import rank_main

START_TIMEOUT = 600.0
STEP_TIMEOUT = 600.0

_enc = msgspec.msgpack.Encoder()
_release = p.Decoder[p.Release](p.Release)


class RankFailed(PdserveError):
    """A rank process died or reported an error."""


class RankGroup:
    def __init__(self, config: EngineConfig, num_ranks: int, engine_id: str, epoch: int) -> None:
        ctx = mp.get_context("spawn")
        dist_addr = f"tcp://127.0.0.1:{free_port()}"
        self.num_ranks = num_ranks
        self.conns: list[Any] = []
        self.procs: list[Any] = []
        for rank in range(num_ranks):
            parent, child = ctx.Pipe()
            proc = ctx.Process(
                target=rank_main, name=f"pdserve-prefill-{engine_id}-rank{rank}", daemon=True,
                args=(rank, num_ranks, dist_addr, msgspec.json.encode(config), engine_id, epoch, child),
            )
            proc.start()
            self.conns.append(parent)
            self.procs.append(proc)
        self._released: list[tuple[int, p.Release]] = []
        self.handshake_replies: list[p.HandshakeReply] = []
        for rank in range(num_ranks):
            msg = self._expect(rank, "ready", START_TIMEOUT)
            self.handshake_replies.append(msgspec.msgpack.decode(msg[1], type=p.HandshakeReply))
        self.layout: KVLayout = self.handshake_replies[0].layout

    def execute(self, plan: StepPlan) -> torch.Tensor:
        payload = _enc.encode(("step", msgspec.msgpack.encode(plan)))
        for conn in self.conns:
            conn.send_bytes(payload)
        logits = torch.empty(0)
        for rank in range(self.num_ranks):
            msg = self._expect(rank, "logits" if rank == 0 else "done", STEP_TIMEOUT)
            if rank == 0:
                buf = np.frombuffer(msg[2], dtype=np.float32).reshape(msg[1])
                logits = torch.from_numpy(buf.copy())
        return logits

    def poll_releases(self) -> list[tuple[int, p.Release]]:
        for rank, conn in enumerate(self.conns):
            while conn.poll(0):
                self._take(rank, msgspec.msgpack.decode(conn.recv_bytes()))
        out, self._released = self._released, []
        return out

    def cache_blocks(self, rank: int, block_ids: list[int]) -> np.ndarray:
        """Rank ``rank``'s copy of ``block_ids`` as float32 (tests compare replicas)."""
        self.conns[rank].send_bytes(_enc.encode(("blocks", block_ids)))
        return np.frombuffer(self._expect(rank, "blocks", STEP_TIMEOUT)[1], dtype=np.float32)

    def close(self) -> None:
        for conn in self.conns:
            try:
                conn.send_bytes(_enc.encode(("stop",)))
            except OSError:
                pass
        for proc in self.procs:
            proc.join(10)
            if proc.is_alive():
                proc.kill()

    def _expect(self, rank: int, kind: str, timeout: float) -> list[Any]:
        """The next message of ``kind`` from ``rank``; releases met on the way are kept."""
        conn, deadline = self.conns[rank], time.monotonic() + timeout
        while True:
            if not self.procs[rank].is_alive() and not conn.poll(0):
                raise RankFailed(f"prefill rank {rank} died (exit code {self.procs[rank].exitcode})")
            if not conn.poll(min(1.0, max(0.0, deadline - time.monotonic()))):
                if time.monotonic() >= deadline:
                    raise RankFailed(f"prefill rank {rank} gave no {kind!r} within {timeout:.0f} s")
                continue
            try:
                msg = msgspec.msgpack.decode(conn.recv_bytes())
            except EOFError as exc:
                raise RankFailed(f"prefill rank {rank} closed its pipe") from exc
            if msg[0] == kind:
                return msg
            self._take(rank, msg)

    def _take(self, rank: int, msg: list[Any]) -> None:
        if msg[0] == "released":
            self._released += [(rank, _release.decode(raw)) for raw in msg[1]]
        elif msg[0] == "error":
            raise RankFailed(msg[1])
        else:
            raise RankFailed(f"prefill rank {rank} sent an unexpected {msg[0]!r}")
