"""RankGroup: the prefill coordinator's handle on its TP x PCP rank processes.

Each rank's NIXL agent serves its heads of every block (a full replica of them under
PCP). Releases the agents receive come back here, one per rank, and the lease table
frees a request only when every rank has reported.
"""

from __future__ import annotations

from pdserve.common.engine.config import EngineConfig
from pdserve.common.runtime import protocol as p
from pdserve.services.ranks import messages as m
from pdserve.services.ranks.group import RankFailed, RankProcesses

__all__ = ["RankFailed", "RankGroup"]


class RankGroup(RankProcesses):
    def __init__(
        self, config: EngineConfig, pcp: int, engine_id: str, epoch: int, tp: int = 1
    ) -> None:
        super().__init__(
            "prefill",
            config,
            f"prefill-{engine_id}",
            tp=tp,
            pcp=pcp,
            agent={"engine_id": engine_id, "epoch": epoch},
        )

    def poll_releases(self) -> list[tuple[int, p.Release]]:
        return [
            (rank, release)
            for rank, event in self.take_events()
            if isinstance(event, m.Released)
            for release in event.releases
        ]
