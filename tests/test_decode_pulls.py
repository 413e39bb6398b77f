"""The decode engine thread's pull lifecycle (services/decode/engine_thread.py and its
pulls' table, pending.py) driven turn by turn, without a model or NIXL: a fake engine over a
real Scheduler and BlockPool (the scheduler owns the blocks: WAITING_FOR_REMOTE_KV), a fake
puller, replies collected in place of the service's sockets. Every request ends with
exactly one terminal reply, every replica is released exactly once, every block comes
back."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest

from pdserve.common.engine.block_pool import BlockPool
from pdserve.common.engine.kv_layout import KVLayout
from pdserve.common.engine.outputs import RequestOutput
from pdserve.common.engine.request import RemoteKV, Request
from pdserve.common.engine.sampling_params import SamplingParams
from pdserve.common.engine.scheduler import Scheduler
from pdserve.common.runtime import protocol as p
from pdserve.common.runtime.engine_commands import Abort, Connected, Decode, HandshakeFailed
from pdserve.common.runtime.fault_hooks import FaultHooks
from pdserve.common.runtime.metrics import Metrics
from pdserve.common.runtime.service_config import DeploymentConfig
from pdserve.common.transfer.kv_pulls import PullResult, PullSpec
from pdserve.common.transfer.kv_transfer import KVTransferError
from pdserve.services.decode.engine_thread import DecodeContext, DecodeEngineThread

BLOCK = 4
NUM_BLOCKS = 8
ENGINE, EPOCH = "prefill-0", 7
LAYOUT = KVLayout(
    num_blocks=NUM_BLOCKS, num_layers=2, num_kv_heads=2, block_size=BLOCK, head_dim=8,
    dtype="float32",
)  # fmt: skip


class FakeModelConfig:
    num_key_value_heads = 2


class FakeEngine:
    """What the engine thread needs of a DecodeEngine, over a real Scheduler (the one owner
    of the blocks); admitted requests finish at once."""

    def __init__(self) -> None:
        self.pool = BlockPool(NUM_BLOCKS)
        self.scheduler = Scheduler(self.pool, BLOCK, max_num_seqs=8, max_num_batched_tokens=64)
        self.model_config = FakeModelConfig()
        self.has_unfinished = False
        self.last_step_tokens = 0
        self.requests: dict[str, Request] = {}
        self.admitted: list[tuple[str, list[int] | None]] = []

    def add_remote(
        self,
        rid: str,
        prompt: list[int],
        sampling: SamplingParams,
        remote: RemoteKV,
        client: str = "",
        priority: int = 0,
    ) -> None:
        req = Request(rid, prompt, sampling)
        req.remote = remote
        self.scheduler.add_remote(req)
        self.requests[rid] = req

    def reserve_remote(self, rid: str) -> list[int] | None:
        req = self.requests[rid]
        return req.held_block_ids if self.scheduler.reserve_remote(req) else None

    def pulled(self, rid: str) -> RequestOutput:
        req = self.requests.pop(rid)
        self.admitted.append((rid, req.held_block_ids))
        self.scheduler.remote_kv_arrived(req)
        return self._done_at_first_token(req)

    def pull_failed(self, rid: str, recompute: bool) -> RequestOutput | None:
        req = self.requests.pop(rid)
        self.scheduler.remote_kv_failed(req, recompute)
        if not recompute:
            return None
        self.admitted.append((rid, None))
        return self._done_at_first_token(req)

    def _done_at_first_token(self, req: Request) -> RequestOutput:
        assert req.remote is not None
        self.scheduler.finish(req, "length")
        return RequestOutput(request_id=req.request_id, new_token_ids=[req.remote.first_token],
                             text="x", finished=True, finish_reason="length",
                             num_prompt_tokens=req.num_prompt_tokens, num_output_tokens=1)  # fmt: skip

    def abort(self, rid: str) -> RequestOutput | None:
        req = self.requests.pop(rid, None)
        if req is None:
            return None
        self.scheduler.finish(req, "abort")
        return RequestOutput(request_id=rid, new_token_ids=[], text="", finished=True,
                             finish_reason="abort", num_prompt_tokens=req.num_prompt_tokens,
                             num_output_tokens=0)  # fmt: skip


class FakePuller:
    """A Puller whose READs end when the test says so."""

    def __init__(self) -> None:
        self.connected: list[str] = []
        self.started: list[tuple[str, list[list[PullSpec]]]] = []
        self.results: list[PullResult] = []
        self.released: list[str] = []
        self.unreached: list[int] = []  # replica indices a release does not reach

    def connect(self, replies: list[p.HandshakeReply]) -> None:
        self.connected += [r.agent_name for r in replies]

    def start(self, rid: str, handle: p.KVHandle, plan: list[list[PullSpec]]) -> None:
        self.started.append((rid, plan))

    def poll(self) -> list[PullResult]:
        out, self.results = self.results, []
        return out

    def release(self, handle: p.KVHandle, rid: str, trace_id: str) -> list[int]:
        self.released.append(rid)
        return list(self.unreached)

    def close(self) -> None:
        pass


class Harness:
    def __init__(self, policy: str = "fail", faults: FaultHooks | None = None) -> None:
        self.replies: list[p.Message] = []
        self.side: list[tuple[str, p.Message]] = []
        ctx = DecodeContext(
            cfg=DeploymentConfig(kv_load_failure_policy=policy),
            instance=0,
            torch_threads=1,
            metrics=Metrics("decode", 0),
            reply=lambda identity, msg: self.replies.append(msg),
            send_side=lambda address, msg: self.side.append((address, msg)),
            faults=faults or FaultHooks(),
        )
        self.loop = asyncio.new_event_loop()
        self.thread = DecodeEngineThread(ctx, self.loop)  # never started: turns by hand
        self.thread.post = lambda callback, *args: callback(*args)  # type: ignore[method-assign]
        self.engine = FakeEngine()
        self.puller = FakePuller()
        self.thread.engine = self.engine  # type: ignore[assignment]
        self.thread.puller = self.puller
        self.thread.tp = 1
        self.thread.metrics = ctx.metrics
        self.thread.open_pulls()

    def turn(self, *commands: Any) -> bool:
        for command in commands:
            self.thread.handlers[type(command)](command)
        return self.thread.run_once()

    def terminal(self, rid: str) -> list[p.Message]:
        return [m for m in self.replies if isinstance(m, p.Finished | p.Failed)
                and m.request_id == rid]  # fmt: skip


@pytest.fixture
def h() -> Iterator[Harness]:
    harness = Harness()
    yield harness
    harness.loop.close()


def handle(num_tokens: int = 10, num_replicas: int = 1) -> p.KVHandle:
    replicas = [
        p.Replica(agent_name=f"{ENGINE}-e{EPOCH}-r{r}", side_channel=f"tcp://side:{r}", pcp_rank=r)
        for r in range(num_replicas)
    ]
    return p.KVHandle(engine_id=ENGINE, epoch=EPOCH, layout=LAYOUT, block_ids=[5, 6, 7],
                      num_tokens=num_tokens, replicas=replicas, lease_deadline=0.0)  # fmt: skip


def decode(rid: str, h: p.KVHandle) -> Decode:
    msg = p.DecodeRequest(request_id=rid, trace_id=f"t-{rid}", prompt_token_ids=list(range(10)),
                          sampling=SamplingParams(max_tokens=4), first_token=42, handle=h)  # fmt: skip
    return Decode(identity=b"router", request=msg)


def connected(num_replicas: int = 1) -> Connected:
    replies = [
        p.HandshakeReply(
            engine_id=ENGINE,
            epoch=EPOCH,
            agent_name=f"{ENGINE}-e{EPOCH}-r{r}",
            layout=LAYOUT,
            compat={},
            payload=b"m",
            pcp_rank=r,
            pcp_size=num_replicas,
        )  # fmt: skip
        for r in range(num_replicas)
    ]
    return Connected(key=(ENGINE, EPOCH), replies=replies)


def test_a_pull_waits_for_the_handshake_then_admits_and_releases(h: Harness) -> None:
    h.turn(decode("a", handle()))
    assert h.puller.started == []  # the producer is not connected yet
    # heartbeat targets: (engine, epoch, request ids, their handles' tokens)
    assert h.thread.pending_by_producer == {"tcp://side:0": (ENGINE, EPOCH, ["a"], [""])}
    h.turn(connected())
    [(rid, plan)] = h.puller.started
    assert rid == "a" and len(plan) == 1 and plan[0][0].remote_block_ids == [5, 6, 7]
    local = plan[0][0].local_block_ids
    assert len(local) == 3 and h.engine.pool.num_free_blocks == NUM_BLOCKS - 3
    h.puller.results.append(PullResult("a", None, num_bytes=100, num_descriptors=1))
    h.turn()
    assert h.engine.admitted == [("a", local)]
    assert h.puller.released == ["a"]
    [chunk] = [m for m in h.replies if isinstance(m, p.TokenChunk)]
    assert chunk.token_ids == [42] and {"pull_started", "pull_done"} <= set(chunk.timings)
    assert [type(m) for m in h.terminal("a")] == [p.Finished]
    assert h.thread.pending_by_producer == {} and h.engine.pool.num_free_blocks == NUM_BLOCKS
    assert h.thread.metrics.value("pdserve:kv_transfers") == 1


def test_a_failed_pull_fails_the_request_frees_its_blocks_and_releases(h: Harness) -> None:
    h.turn(connected(), decode("a", handle()))
    h.puller.results.append(PullResult("a", "READ failed: remote gone"))
    h.turn()
    [failed] = h.terminal("a")
    assert isinstance(failed, p.Failed) and failed.reason == "kv_transfer"
    assert ENGINE in failed.message and "remote gone" in failed.message
    assert h.puller.released == ["a"] and h.engine.admitted == []
    assert h.engine.pool.num_free_blocks == NUM_BLOCKS


def test_recompute_policy_admits_without_blocks() -> None:
    h = Harness(policy="recompute")
    h.turn(connected(), decode("a", handle()))
    h.puller.results.append(PullResult("a", "READ failed"))
    h.turn()
    assert h.engine.admitted == [("a", None)]
    assert [type(m) for m in h.terminal("a")] == [p.Finished]
    assert h.puller.released == ["a"] and h.engine.pool.num_free_blocks == NUM_BLOCKS
    h.loop.close()


def test_an_abort_during_the_pull_waits_for_the_reads_then_finishes(h: Harness) -> None:
    h.turn(connected(), decode("a", handle()))
    h.turn(Abort(request_id="a"))
    assert h.terminal("a") == []  # a posted READ cannot be recalled: wait for it
    h.puller.results.append(PullResult("a", None))
    h.turn()
    [done] = h.terminal("a")
    assert isinstance(done, p.Finished) and done.finish_reason == "abort"
    assert h.puller.released == ["a"] and h.engine.admitted == []
    assert h.engine.pool.num_free_blocks == NUM_BLOCKS


def test_an_abort_before_the_pull_releases_at_once(h: Harness) -> None:
    h.turn(decode("a", handle()))
    h.turn(Abort(request_id="a"))
    [done] = h.terminal("a")
    assert isinstance(done, p.Finished) and done.finish_reason == "abort"
    # released once, through the puller (which reports the replicas it cannot reach)
    assert h.puller.released == ["a"] and h.side == []


def test_a_failed_handshake_fails_waiting_requests_without_a_nixl_release(h: Harness) -> None:
    h.turn(decode("a", handle()), decode("b", handle()))
    h.turn(HandshakeFailed(key=(ENGINE, EPOCH), message="timed out"))
    for rid in ("a", "b"):
        [failed] = h.terminal(rid)
        assert isinstance(failed, p.Failed) and "timed out" in failed.message
    assert h.puller.released == [] and h.puller.started == []


def test_releases_no_notification_reached_go_over_the_side_channel(h: Harness) -> None:
    h.puller.unreached = [1]
    h.turn(connected(2), decode("a", handle(num_replicas=2)))
    h.puller.results.append(PullResult("a", None))
    h.turn()
    [(address, release)] = h.side
    assert address == "tcp://side:1" and isinstance(release, p.Release) and release.rank == 1
    assert h.thread.metrics.value("pdserve:kv_notification_failures") == 1


def test_requests_wait_for_free_blocks(h: Harness) -> None:
    h.turn(connected(), decode("a", handle(num_tokens=24)), decode("b", handle(num_tokens=12)))
    assert [rid for rid, _ in h.puller.started] == ["a"]  # 6 of 8 blocks: b (3) waits
    h.puller.results.append(PullResult("a", None))
    h.turn()
    h.turn()
    assert [rid for rid, _ in h.puller.started] == ["a", "b"]


def test_held_pulls_start_once_the_hold_file_is_gone(tmp_path: Any) -> None:
    hold = tmp_path / "hold"
    hold.touch()
    h = Harness(faults=FaultHooks(hold_pulls_file=str(hold)))
    h.turn(connected(), decode("a", handle()))
    assert h.puller.started == []
    hold.unlink()
    h.turn()
    assert [rid for rid, _ in h.puller.started] == ["a"]
    h.loop.close()


def test_the_scheduler_holds_requests_waiting_for_their_kv_and_their_blocks(h: Harness) -> None:
    waiting = h.engine.scheduler.waiting_for_remote_kv
    h.turn(connected(), decode("a", handle(num_tokens=24)), decode("b", handle(num_tokens=12)))
    assert set(waiting) == {"a", "b"}  # a pulling into 6 blocks, b waiting for 3
    assert len(waiting["a"].held_block_ids) == 6 and waiting["b"].held_block_ids == []
    h.turn(Abort(request_id="b"))  # waiting for blocks: ends at once, nothing to free
    assert set(waiting) == {"a"} and h.engine.pool.num_free_blocks == NUM_BLOCKS - 6
    h.puller.results.append(PullResult("a", "READ failed"))
    h.turn()
    assert waiting == {} and h.engine.pool.num_free_blocks == NUM_BLOCKS
    assert [type(m) for m in h.terminal("a") + h.terminal("b")] == [p.Failed, p.Finished]


def test_a_request_forgotten_mid_pull_keeps_its_blocks_until_the_reads_end(h: Harness) -> None:
    h.turn(connected(), decode("a", handle()))
    h.thread.forget("a")  # a command of it failed: answered there
    assert h.engine.pool.num_free_blocks == NUM_BLOCKS - 3  # a READ still lands in them
    h.puller.results.append(PullResult("a", None))
    h.turn()
    assert h.engine.pool.num_free_blocks == NUM_BLOCKS and h.thread.pulls.requests == {}
    assert h.terminal("a") == [] and h.puller.released == ["a"]


def test_a_producer_a_pull_could_not_reach_is_reported_until_reconnected(h: Harness) -> None:
    """What the decode's Pongs name (router pairs it with other prefills meanwhile): set by
    a transport failure, not by a refusal; cleared by the reconnect or a pull that works."""
    h.turn(connected(), decode("a", handle()))
    h.puller.results.append(
        PullResult("a", f"KV pull of request 'a' from {ENGINE}: refused, stale")
    )
    h.turn()
    assert h.thread.unreachable_producers == []
    h.turn(decode("b", handle()))
    h.puller.results.append(
        PullResult("b", f"KV pull of request 'b' from {ENGINE}: transfer failed: NIXL state ERR")
    )
    h.turn()
    assert h.thread.unreachable_producers == [ENGINE]
    h.turn(decode("c", handle()))
    why = "unreachable since a READ from it failed; reconnecting in 1.5 s"
    h.puller.results.append(PullResult("c", f"KV pull of request 'c' from {ENGINE}: {why}"))
    h.turn()
    assert h.thread.unreachable_producers == [ENGINE]
    h.turn(connected())  # connect ahead reached its side channel again: reconnected
    assert h.thread.unreachable_producers == []
    h.turn(decode("d", handle()))
    h.puller.results.append(PullResult("d", "reconnecting failed: KV handshake timed out"))
    h.turn()
    assert h.thread.unreachable_producers == [ENGINE]
    h.turn(decode("e", handle()))
    h.puller.results.append(PullResult("e", None, num_bytes=1, num_descriptors=1))
    h.turn()
    assert h.thread.unreachable_producers == []
    assert all(len(h.terminal(rid)) == 1 for rid in "abcde")
    assert h.engine.pool.num_free_blocks == NUM_BLOCKS


def test_a_failed_reconnect_keeps_the_producer_unreachable_not_refused(h: Harness) -> None:
    """Connect ahead reached the side channel but reloading the NIXL metadata failed: the
    producer stays reported unreachable and its requests still pull (and may reconnect
    then); only a first handshake that fails refuses a producer."""
    h.turn(connected(), decode("a", handle()))
    h.puller.results.append(PullResult("a", "transfer failed: NIXL state ERR"))
    h.turn()
    assert h.thread.unreachable_producers == [ENGINE]

    def refuse(replies: list[p.HandshakeReply]) -> None:
        raise KVTransferError("loading its NIXL metadata failed: timed out")

    h.puller.connect = refuse  # type: ignore[method-assign]
    h.turn(connected())
    assert h.thread.unreachable_producers == [ENGINE]
    h.turn(decode("b", handle()))
    assert [rid for rid, _ in h.puller.started] == ["a", "b"]  # pulled, not refused
    h.puller.results.append(PullResult("b", None, num_bytes=1, num_descriptors=1))
    h.turn()
    assert h.thread.unreachable_producers == []
    assert [type(m) for m in h.terminal("b")] == [p.Finished]
