"""How a decode instance moves a request's prompt KV in: the pull plan and the pullers.

:func:`plan_pulls` maps a producer's TP x PCP grid onto this instance's TP ranks: each
decode rank reads its KV heads from the producer TP rank(s) holding them (common/parallel/tp.py),
from the first PCP replica or, with ``pull_from = "striped"``, one share of the blocks
from each replica. Whatever was read from, every replica is released exactly once.

A ``Puller`` (common/transfer/kv_pulls.py) runs the plan: the transfer backend's consumer
in this process (TP 1; common/transfer/registry.py), :class:`RankPuller` through the decode
rank processes (TP > 1), where each rank's consumer posts its own READs and rank 0 sends the
releases (it connects to every producer rank).
Both report a request once, when every READ of it has ended.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pdserve.common.parallel.tp import pull_plan
from pdserve.common.runtime import protocol as p
from pdserve.common.transfer.kv_pulls import PullResult, PullSpec
from pdserve.common.transfer.kv_transfer import KVTransferError
from pdserve.services.ranks import messages as m

if TYPE_CHECKING:
    from pdserve.common.engine.config import EngineConfig
    from pdserve.common.transfer.kv_pulls import Puller
    from pdserve.services.decode.decode_engine import DecodeEngine
    from pdserve.services.ranks.group import RankGroup


def plan_pulls(
    handle: p.KVHandle, local_blocks: list[int], num_kv_heads: int, consumer_tp: int, striped: bool
) -> list[list[PullSpec]]:
    """The READs of each decode rank (index = rank)."""
    grid = {(r.tp_rank, r.pcp_rank): i for i, r in enumerate(handle.replicas)}
    producer_tp = 1 + max(r.tp_rank for r in handle.replicas)
    pcp = 1 + max(r.pcp_rank for r in handle.replicas)
    if len(grid) != producer_tp * pcp or len(grid) != len(handle.replicas):
        raise KVTransferError(
            f"handle of {handle.engine_id!r} names an incomplete or repeated TP x PCP grid: "
            f"{[(r.tp_rank, r.pcp_rank) for r in handle.replicas]}"
        )
    shares = max(1, min(pcp if striped else 1, len(local_blocks)))
    bounds = [len(local_blocks) * i // shares for i in range(shares + 1)]
    plan = []
    for rank in range(consumer_tp):
        specs = []
        for sl in pull_plan(num_kv_heads, producer_tp, consumer_tp, rank):
            for share, (a, b) in enumerate(itertools.pairwise(bounds)):
                # decode ranks start their shares on different replicas: more source links busy
                replica = grid[(sl.producer_tp_rank, (share + rank) % pcp if striped else 0)]
                specs.append(
                    PullSpec(
                        replica,
                        handle.block_ids[a:b],
                        local_blocks[a:b],
                        [(sl.src_head, sl.dst_head, sl.num_heads)],
                        handle.host_slots[a:b],
                    )
                )
        plan.append(specs)
    return plan


@dataclass
class _Outstanding:
    ranks: set[int]
    error: str | None = None
    num_bytes: int = 0
    num_descriptors: int = 0
    seconds: float = 0.0


class RankPuller:
    """TP > 1: every decode rank process pulls its own heads."""

    def __init__(self, ranks: RankGroup) -> None:
        self.ranks = ranks
        self._out: dict[str, _Outstanding] = {}

    def connect(self, replies: list[p.HandshakeReply]) -> None:
        errors = [
            self.ranks.call(rank, m.Connect(replies), m.Connected).error
            for rank in range(self.ranks.num_ranks)
        ]
        if any(errors):
            raise KVTransferError(next(e for e in errors if e))

    def start(self, rid: str, handle: p.KVHandle, plan: list[list[PullSpec]]) -> None:
        ranks = {rank for rank, specs in enumerate(plan) if specs}
        self._out[rid] = _Outstanding(ranks)
        for rank in ranks:
            self.ranks.send(rank, m.StartPull(rid, handle, plan[rank]))

    def poll(self) -> list[PullResult]:
        done = []
        for rank, event in self.ranks.take_events():
            if isinstance(event, m.Released):  # a producer's event: no decode rank sends it
                continue
            rid = event.request_id
            out = self._out.get(rid)
            if out is None or rank not in out.ranks:
                continue
            out.ranks.discard(rank)
            if isinstance(event, m.PullFailed):
                out.error = out.error or event.message
            else:
                out.num_bytes += event.num_bytes
                out.num_descriptors += event.num_descriptors
                out.seconds = max(out.seconds, event.seconds)
            if not out.ranks:  # only when no READ of the request is still in flight
                del self._out[rid]
                done.append(
                    PullResult(rid, out.error, out.num_bytes, out.num_descriptors, out.seconds)
                )
        return done

    def release(self, handle: p.KVHandle, rid: str, trace_id: str) -> list[int]:
        return self.ranks.call(0, m.ReleaseAll(handle, rid, trace_id), m.Unreached).indices

    @property
    def busy(self) -> bool:
        return bool(self._out)

    def close(self) -> None:
        self.ranks.close()


def open_engine(
    engine_cfg: EngineConfig, tp: int, agent_name: str, name: str, backend: str = "nixl"
) -> tuple[DecodeEngine, Puller]:
    """The decode engine and what pulls into its KV cache with transfer backend ``backend``:
    in this process at TP 1, through a rank group's processes (one consumer each) above.
    ``name``: the instance's (decode-N), for its ranks' command lines."""
    from pdserve.common.engine.model_runner import ModelRunner
    from pdserve.common.transfer.backend import CacheSpec
    from pdserve.common.transfer.registry import transfer_backend
    from pdserve.services.decode.decode_engine import DecodeEngine

    if tp > 1:
        from pdserve.services.ranks.group import RankGroup

        ranks = RankGroup.decode(engine_cfg, tp, agent_name, name, backend)
        return DecodeEngine(engine_cfg, runner=ranks), RankPuller(ranks)
    engine = DecodeEngine(engine_cfg)
    runner = engine.runner
    assert isinstance(runner, ModelRunner)  # in process: no rank group
    spec = CacheSpec(
        agent_name=agent_name,
        kv_cache=runner.kv_cache,
        layout=runner.layout,
        compat=runner.kv_compat(),
    )
    return engine, transfer_backend(backend).consumer(spec)
