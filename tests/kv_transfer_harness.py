"""The KV transfer tests' producers: real processes (spawn) that serve a seeded cache over
NIXL and report the releases and bad notifications they received, and the consumer-side
waits (tests/test_kv_transfer.py)."""

from __future__ import annotations

import time
from multiprocessing.connection import Connection
from typing import Any

import torch

from pdserve.common.engine.kv_cache import new_cache
from pdserve.common.engine.kv_layout import KVLayout
from pdserve.common.runtime.protocol import (
    Decoder,
    HandshakeReply,
    KVHandle,
    Release,
    Replica,
    encode,
)
from pdserve.common.transfer.kv_consumer import KVConsumer

# block_bytes = 2 layers x K,V x 2 heads x 4 tokens x 8 dims x 4 B = 1 KiB; 32 blocks
LAYOUT = KVLayout(
    num_blocks=32, num_layers=2, num_kv_heads=2, block_size=4, head_dim=8, dtype="float32"
)
COMPAT = {"model": "tiny-random", "kv_cache_dtype": "float32"}
ENGINE, EPOCH, SEED = "prefill-0", 7, 1234
AGENTS = ("prefill-0-rank0", "prefill-0-rank1")
VICTIM, VICTIM_ENGINE = "prefill-9-rank0", "prefill-9"
WAIT_S = 20.0
START_WAIT_S = 30.0  # three children importing torch on two (shared) cores


def seeded_cache(layout: KVLayout, seed: int) -> torch.Tensor:
    # logical [num_blocks, num_layers, 2, H_kv, block_size, head_dim] over head-major
    # storage; same bytes in every process
    cache = new_cache(layout)
    cache.copy_(torch.randn(layout.shape, generator=torch.Generator().manual_seed(seed)))
    return cache


def _producer_main(conn: Connection, agent_name: str, engine_id: str = ENGINE) -> None:
    """Child: serve the seeded cache; answer 'state' with (releases, bad count)."""
    torch.set_num_threads(1)
    from pdserve.common.transfer.kv_transfer import KVProducer

    producer = KVProducer(
        engine_id=engine_id,
        epoch=EPOCH,
        agent_name=agent_name,
        kv_cache=seeded_cache(LAYOUT, SEED),
        layout=LAYOUT,
        compat=COMPAT,
    )
    releases: list[bytes] = []
    try:
        conn.send_bytes(encode(producer.handshake_reply))
        while True:
            releases += [encode(r) for r in producer.poll_releases()]
            if conn.poll(0.005):
                if conn.recv() == "stop":
                    return
                conn.send((releases, producer.num_bad_notifications))
    except (EOFError, BrokenPipeError):  # the test process is gone: exit too
        pass
    finally:
        producer.close()


class ProducerProc:
    def __init__(self, ctx: Any, agent_name: str, engine_id: str = ENGINE) -> None:
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(
            target=_producer_main, args=(child, agent_name, engine_id), daemon=True
        )
        self.proc.start()
        child.close()
        self.reply: HandshakeReply | None = None

    def read_reply(self, wait_s: float = WAIT_S) -> HandshakeReply:
        deadline = time.monotonic() + wait_s
        while self.reply is None and not self.conn.poll(0.1):
            assert self.proc.is_alive(), f"producer died at start (exit {self.proc.exitcode})"
            assert time.monotonic() < deadline, "producer gave no handshake reply in time"
        if self.reply is None:
            self.reply = Decoder(HandshakeReply).decode(self.conn.recv_bytes())
        return self.reply

    def state(self) -> tuple[list[Release], int]:
        self.conn.send("state")
        assert self.conn.poll(WAIT_S), "producer did not answer"
        raw, bad = self.conn.recv()
        return [Decoder(Release).decode(r) for r in raw], bad

    def ask_stop(self) -> None:
        try:
            self.conn.send("stop")
        except (OSError, ValueError):  # already gone
            pass

    def stop(self) -> None:
        self.ask_stop()
        self.proc.join(5)
        if self.proc.is_alive():
            self.proc.terminate()
            self.proc.join(5)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)


def make_handle(
    block_ids: list[int], agents: tuple[str, ...] = AGENTS, epoch: int = EPOCH, engine: str = ENGINE
) -> KVHandle:
    return KVHandle(
        engine_id=engine,
        epoch=epoch,
        layout=LAYOUT,
        block_ids=block_ids,
        num_tokens=len(block_ids) * LAYOUT.block_size,
        replicas=[Replica(agent_name=a, side_channel="") for a in agents],
        lease_deadline=time.time() + 30,
    )


def wait_pull(consumer: KVConsumer, pull: Any) -> None:
    deadline = time.monotonic() + WAIT_S
    while not consumer.poll(pull):
        assert time.monotonic() < deadline, f"pull {pull} did not finish in time"
        time.sleep(0.001)


def wait_producer(proc: ProducerProc, ok: Any, consumer: KVConsumer) -> tuple[list[Release], int]:
    deadline = time.monotonic() + WAIT_S
    while True:
        consumer.progress()  # the sender drives its own notifications out
        releases, bad = proc.state()
        if ok(releases, bad):
            return releases, bad
        assert time.monotonic() < deadline, f"producer state not reached: {releases}, bad={bad}"
        time.sleep(0.02)


def connect_all(consumer: KVConsumer, producers: list[ProducerProc]) -> None:
    for p in producers:
        consumer.connect(p.read_reply())
