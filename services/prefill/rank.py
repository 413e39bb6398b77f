"""A prefill context-parallel rank: one process with the weights, a full KV replica and
its own NIXL agent. Its coordinator sends it step plans; it reports step results and the
releases its agent receives (a rank never hides a completion: every one is reported).

Pipe messages are msgpack tuples, never pickle: ("step", plan) / ("blocks", ids) /
("stop",) in; ("ready", handshake, num_blocks) / ("done",) / ("logits", shape, bytes) /
("blocks", bytes) / ("released", [Release...]) / ("error", text) out.
"""

from __future__ import annotations

import os
import traceback
from multiprocessing.connection import Connection
from typing import Any

import msgspec

from pdserve.common import protocol as p
from pdserve.common.step_plan import StepPlan

# Fault injection for tests only: a rank that silently drops every release it receives.
DROP_RELEASES_ENV = "PDSERVE_TEST_DROP_RELEASES_RANK"

_enc = msgspec.msgpack.Encoder()
_plan = msgspec.msgpack.Decoder(StepPlan)


def rank_main(rank: int, world: int, dist_addr: str, config_json: bytes, engine_id: str, epoch: int, conn: Connection) -> None:
    try:
        _serve(rank, world, dist_addr, config_json, engine_id, epoch, conn)
    except Exception as exc:  # reported to the coordinator, which fails the instance
        conn.send_bytes(_enc.encode(("error", f"prefill rank {rank}: {exc}\n{traceback.format_exc()}")))


def _serve(rank: int, world: int, dist_addr: str, config_json: bytes, engine_id: str, epoch: int, conn: Connection) -> None:
    import torch
    import torch.distributed as dist

    from pdserve.common.config import EngineConfig
    from pdserve.common.kv_transfer import KVProducer
    from pdserve.common.model_config import ModelConfig
    from pdserve.common.model_files import resolve_model
    from pdserve.common.model_runner import ModelRunner
    from pdserve.common.parallel import ParallelContext

    config = msgspec.json.decode(config_json, type=EngineConfig)
    torch.set_num_threads(int(os.environ.get("PDSERVE_RANK_THREADS", "1")))
    dist.init_process_group("gloo", init_method=dist_addr, rank=rank, world_size=world)
    model_dir = resolve_model(config.model)
    runner = ModelRunner.from_config(
        ModelConfig.from_dir(model_dir), model_dir, config,
        parallel=ParallelContext(rank, world, dist.group.WORLD),
    )
    # Every replica must have the same block ids: agree on the smallest pool.
    num = torch.tensor([runner.layout.num_blocks])
    dist.all_reduce(num, op=dist.ReduceOp.MIN)
    runner.resize(int(num.item()))
    producer = KVProducer(
        engine_id=engine_id, epoch=epoch, agent_name=f"{engine_id}-e{epoch}-r{rank}",
        kv_cache=runner.kv_cache, layout=runner.layout, compat=runner.kv_compat(),
    )
    drop_releases = os.environ.get(DROP_RELEASES_ENV) == str(rank)
    conn.send_bytes(_enc.encode(("ready", p.encode(producer.handshake_reply), runner.layout.num_blocks)))
    while True:
        if conn.poll(0.005):
            cmd = msgspec.msgpack.decode(conn.recv_bytes())
            if cmd[0] == "stop":
                break
            conn.send_bytes(_enc.encode(_handle(cmd, rank, runner)))
        releases = producer.poll_releases()
        if releases and not drop_releases:
            conn.send_bytes(_enc.encode(("released", [p.encode(r) for r in releases])))
    producer.close()
    dist.destroy_process_group()


def _handle(cmd: list[Any], rank: int, runner: Any) -> tuple[Any, ...]:
    if cmd[0] == "step":
        logits = runner.execute(_plan.decode(cmd[1]))
        if rank != 0:
            return ("done",)
        return ("logits", list(logits.shape), logits.float().cpu().numpy().tobytes())
    if cmd[0] == "blocks":  # tests compare replicas byte for byte
        return ("blocks", runner.kv_cache[cmd[1]].float().cpu().numpy().tobytes())
    raise ValueError(f"unknown rank command {cmd[0]!r}")

