"""DecodeRankGroup: a decode instance's TP rank processes (services/ranks/process.py, role decode).

Each rank holds its heads of the KV cache and its own NIXL agent, which reads those heads
from the producers (services/decode/pullers.py RankPuller); rank 0 returns the logits.
"""

from __future__ import annotations

from pdserve.common.engine.config import EngineConfig
from pdserve.services.ranks.group import RankProcesses


class DecodeRankGroup(RankProcesses):
    def __init__(self, config: EngineConfig, tp: int, agent_name: str) -> None:
        super().__init__("decode", config, agent_name, tp=tp, agent={"name": agent_name})
