"""One rank process of a TP x PCP instance: its shard of the weights, its KV cache (its
heads of every block: a full replica of them under PCP) and its own NIXL agent.

``role`` "prefill": the agent is a KVProducer; releases it receives are reported.
``role`` "decode": the agent is a KVConsumer that pulls this rank's heads.

Pipe messages are msgpack tuples, never pickle. In: ("step", plan) / ("blocks", ids) /
("connect", [reply]) / ("pull", request_id, handle, [spec]) / ("release", handle,
request_id, trace_id) / ("stop",). Out: ("ready", handshake or b"", layout) / ("done",) /
("logits", shape, bytes) / ("blocks", bytes) / ("connected", error) / ("unreached",
[index]) / ("error", text), and the events ("released", [Release]) / ("pulled",
request_id, bytes, descriptors, seconds) / ("pull_failed", request_id, message). A rank
never hides a completion: every release and every pull result is reported.
"""

from __future__ import annotations

import os
import traceback
from multiprocessing.connection import Connection
from typing import Any

import msgspec

from pdserve.common.engine.step_plan import StepPlan
from pdserve.common.runtime import protocol as p
from pdserve.common.transfer.kv_pulls import PullSpec

# Fault injection for tests only: a prefill rank that silently drops every release.
DROP_RELEASES_ENV = "PDSERVE_TEST_DROP_RELEASES_RANK"

_enc = msgspec.msgpack.Encoder()
_plan = msgspec.msgpack.Decoder(StepPlan)
_handle = msgspec.msgpack.Decoder(p.KVHandle)


_specs = msgspec.msgpack.Decoder(list[PullSpec])


def rank_main(
    role: str, rank: int, tp: int, pcp: int, dist_addr: str, setup: bytes, conn: Connection
) -> None:
    try:
        _serve(role, rank, tp, pcp, dist_addr, setup, conn)
    except Exception as exc:  # reported to the coordinator, which fails the instance
        conn.send_bytes(
            _enc.encode(("error", f"{role} rank {rank}: {exc}\n{traceback.format_exc()}"))
        )


def _serve(
    role: str, rank: int, tp: int, pcp: int, dist_addr: str, setup: bytes, conn: Connection
) -> None:
    import torch
    import torch.distributed as dist

    from pdserve.common.engine.config import EngineConfig
    from pdserve.common.engine.model_runner import ModelRunner
    from pdserve.common.model.config import ModelConfig
    from pdserve.common.model.files import resolve_model
    from pdserve.common.parallel.context import init_grid

    spec = msgspec.json.decode(setup)
    config = msgspec.convert(spec["config"], EngineConfig)
    torch.set_num_threads(int(os.environ.get("PDSERVE_RANK_THREADS", "1")))
    dist.init_process_group("gloo", init_method=dist_addr, rank=rank, world_size=tp * pcp)
    model_dir = resolve_model(config.model)
    runner = ModelRunner.from_config(
        ModelConfig.from_dir(model_dir), model_dir, config, parallel=init_grid(tp, pcp, rank)
    )
    # Every rank must have the same block ids: agree on the smallest pool.
    num = torch.tensor([runner.layout.num_blocks])
    dist.all_reduce(num, op=dist.ReduceOp.MIN)
    runner.resize(int(num.item()))
    par = runner.parallel
    agent: _Role = (_Producer if role == "prefill" else _Consumer)(spec["agent"], rank, par, runner)
    conn.send_bytes(_enc.encode(("ready", agent.handshake, msgspec.msgpack.encode(runner.layout))))
    try:
        while True:
            if conn.poll(0.001 if agent.busy else 0.005):
                cmd = msgspec.msgpack.decode(conn.recv_bytes())
                if cmd[0] == "stop":
                    break
                reply = (
                    _step(cmd, rank, runner) if cmd[0] in ("step", "blocks") else agent.handle(cmd)
                )
                if reply is not None:
                    conn.send_bytes(_enc.encode(reply))
            for event in agent.poll():
                conn.send_bytes(_enc.encode(event))
    finally:
        agent.close()
    dist.destroy_process_group()


def _step(cmd: list[Any], rank: int, runner: Any) -> tuple[Any, ...]:
    if cmd[0] == "step":
        logits = runner.execute(_plan.decode(cmd[1]))
        if rank != 0:
            return ("done",)
        return ("logits", list(logits.shape), logits.float().cpu().numpy().tobytes())
    # ("blocks", ids): tests compare replicas byte for byte
    return ("blocks", runner.kv_cache[cmd[1]].float().cpu().numpy().tobytes())


class _Role:
    handshake: bytes = b""
    busy = False

    def handle(self, cmd: list[Any]) -> tuple[Any, ...] | None:
        raise ValueError(f"unknown rank command {cmd[0]!r}")

    def poll(self) -> list[tuple[Any, ...]]:
        return []

    def close(self) -> None:
        pass


class _Producer(_Role):
    def __init__(self, spec: dict[str, Any], rank: int, par: Any, runner: Any) -> None:
        from pdserve.common.transfer.kv_transfer import KVProducer

        engine_id, epoch = spec["engine_id"], spec["epoch"]
        self.producer = KVProducer(
            engine_id=engine_id,
            epoch=epoch,
            agent_name=f"{engine_id}-e{epoch}-r{rank}",
            kv_cache=runner.kv_cache,
            layout=runner.layout,
            compat=runner.kv_compat(),
            tp_rank=par.tp_rank,
            tp_size=par.tp_size,
            pcp_rank=par.pcp_rank,
            pcp_size=par.pcp_size,
        )
        self.handshake = p.encode(self.producer.handshake_reply)
        self.drop_releases = os.environ.get(DROP_RELEASES_ENV) == str(rank)

    def poll(self) -> list[tuple[Any, ...]]:
        releases = self.producer.poll_releases()
        if releases and not self.drop_releases:
            return [("released", [p.encode(r) for r in releases])]
        return []

    def close(self) -> None:
        self.producer.close()


class _Consumer(_Role):
    def __init__(self, spec: dict[str, Any], rank: int, par: Any, runner: Any) -> None:
        from pdserve.common.transfer.kv_pulls import LocalPuller

        self.puller = LocalPuller(f"{spec['name']}-r{rank}", runner)

    @property
    def busy(self) -> bool:  # type: ignore[override]
        return self.puller.busy

    def handle(self, cmd: list[Any]) -> tuple[Any, ...] | None:
        from pdserve.common.errors import PdserveError

        kind = cmd[0]
        if kind == "connect":
            try:
                self.puller.connect(
                    [msgspec.msgpack.decode(raw, type=p.HandshakeReply) for raw in cmd[1]]
                )
            except PdserveError as exc:
                return ("connected", str(exc))
            return ("connected", "")
        if kind == "pull":
            self.puller.start(cmd[1], _handle.decode(cmd[2]), [_specs.decode(cmd[3])])
            return None
        if kind == "release":
            return ("unreached", self.puller.release(_handle.decode(cmd[1]), cmd[2], cmd[3]))
        return super().handle(cmd)

    def poll(self) -> list[tuple[Any, ...]]:
        return [
            ("pull_failed", r.request_id, r.error)
            if r.error is not None
            else ("pulled", r.request_id, r.num_bytes, r.num_descriptors, r.seconds)
            for r in self.puller.poll()
        ]

    def close(self) -> None:
        self.puller.close()
