"""One rank process of a TP x PCP instance: its shard of the weights, its KV cache (its
heads of every block: a full replica of them under PCP) and its own NIXL agent.

``role`` "prefill": the agent is its transfer backend's producer (common/transfer/backend.py;
NIXL's KVProducer); releases it receives are reported.
``role`` "decode": the agent is the backend's consumer, pulling this rank's heads.

Pipe messages are the Structs of services/ranks/messages.py (msgpack, never pickle). A
rank never hides a completion: every release and every pull result is reported.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import traceback
from multiprocessing.connection import Connection
from typing import Any

import msgspec
import setproctitle

from pdserve.common.runtime import protocol as p
from pdserve.common.runtime.fault_hooks import FaultHooks
from pdserve.common.runtime.parent_watch import exit_with_parent
from pdserve.services.ranks import messages as m

# How long an idle rank waits for a command before it polls its NIXL agent again: 5 ms,
# doubling while nothing comes, up to 20 ms (a release is reported at most that late).
IDLE_WAIT = 0.005
IDLE_WAIT_MAX = 0.02


def rank_main(
    role: str,
    rank: int,
    tp: int,
    pcp: int,
    dist_addr: str,
    setup: bytes,
    conn: Connection,
    owner: int,
) -> None:
    # pdserve-decode-0-rank1 (RankGroup names the process): else the forkserver's command line
    setproctitle.setproctitle(mp.current_process().name)
    exit_with_parent(owner)  # the service (the forkserver that forked this rank outlives it)
    try:
        _serve(role, rank, tp, pcp, dist_addr, setup, conn)
    except Exception as exc:  # reported to the coordinator, which fails the instance
        conn.send_bytes(
            m.encode(m.RankError(f"{role} rank {rank}: {exc}\n{traceback.format_exc()}"))
        )


def _serve(
    role: str, rank: int, tp: int, pcp: int, dist_addr: str, setup: bytes, conn: Connection
) -> None:
    import torch
    import torch.distributed as dist

    from pdserve.common.engine.config import EngineConfig
    from pdserve.common.engine.model_runner import ModelRunner
    from pdserve.common.model.checkpoint.config import ModelConfig
    from pdserve.common.model.checkpoint.files import resolve_model
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
    conn.send_bytes(m.encode(m.Ready(agent.handshake, runner.layout)))
    wait = IDLE_WAIT
    try:
        while True:
            heard = conn.poll(0.001 if agent.busy else wait)
            if heard:
                cmd = m.to_rank.decode(conn.recv_bytes())
                if isinstance(cmd, m.Stop):
                    break
                reply = (
                    _step(cmd, rank, runner)
                    if isinstance(cmd, m.Step | m.ReadBlocks)
                    else agent.handle(cmd)
                )
                if reply is not None:
                    conn.send_bytes(m.encode(reply))
            events = agent.poll()
            for event in events:
                conn.send_bytes(m.encode(event))
            # A quiet rank polls its agent less often (a command still wakes it at once).
            wait = IDLE_WAIT if heard or events else min(2 * wait, IDLE_WAIT_MAX)
    finally:
        agent.close()
    dist.destroy_process_group()


def _step(cmd: m.Step | m.ReadBlocks, rank: int, runner: Any) -> m.RankMessage:
    if isinstance(cmd, m.Step):
        logits = runner.execute(cmd.plan)
        scores = runner.last_prompt_logprobs
        if rank != 0:
            return m.StepDone(scores)
        return m.Logits(list(logits.shape), logits.float().cpu().numpy().tobytes(), scores)
    # tests compare replicas byte for byte
    return m.BlockBytes(runner.kv_cache[cmd.block_ids].float().cpu().numpy().tobytes())


class _Role:
    handshake: p.HandshakeReply | None = None
    busy = False

    def handle(self, cmd: m.ToRank) -> m.RankMessage | None:
        raise ValueError(f"unknown rank command {type(cmd).__name__!r}")

    def poll(self) -> list[m.RankMessage]:
        return []

    def close(self) -> None:
        pass


class _Producer(_Role):
    def __init__(self, spec: dict[str, Any], rank: int, par: Any, runner: Any) -> None:
        from pdserve.common.transfer.backend import ProducerSpec
        from pdserve.common.transfer.registry import transfer_backend

        engine_id, epoch = spec["engine_id"], spec["epoch"]
        self.producer = transfer_backend(spec["backend"]).producer(
            ProducerSpec(
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
        )
        self.handshake = self.producer.handshake_reply
        self.drop_releases = FaultHooks.from_env().drop_releases_rank == rank

    def poll(self) -> list[m.RankMessage]:
        releases = self.producer.poll_releases()
        if releases and not self.drop_releases:
            return [m.Released(releases)]
        return []

    def close(self) -> None:
        self.producer.close()


class _Consumer(_Role):
    def __init__(self, spec: dict[str, Any], rank: int, par: Any, runner: Any) -> None:
        from pdserve.common.transfer.backend import CacheSpec
        from pdserve.common.transfer.registry import transfer_backend

        self.puller = transfer_backend(spec["backend"]).consumer(
            CacheSpec(
                agent_name=f"{spec['name']}-r{rank}",
                kv_cache=runner.kv_cache,
                layout=runner.layout,
                compat=runner.kv_compat(),
            )
        )

    @property
    def busy(self) -> bool:  # type: ignore[override]
        return self.puller.busy

    def handle(self, cmd: m.ToRank) -> m.RankMessage | None:
        from pdserve.common.errors import PdserveError

        if isinstance(cmd, m.Connect):
            try:
                self.puller.connect(cmd.replies)
            except PdserveError as exc:
                return m.Connected(str(exc))
            return m.Connected("")
        if isinstance(cmd, m.StartPull):
            self.puller.start(cmd.request_id, cmd.handle, [cmd.specs])
            return None
        if isinstance(cmd, m.ReleaseAll):
            return m.Unreached(self.puller.release(cmd.handle, cmd.request_id, cmd.trace_id))
        return super().handle(cmd)

    def poll(self) -> list[m.RankMessage]:
        return [
            m.PullFailed(r.request_id, r.error)
            if r.error is not None
            else m.Pulled(r.request_id, r.num_bytes, r.num_descriptors, r.seconds)
            for r in self.puller.poll()
        ]

    def close(self) -> None:
        self.puller.close()
