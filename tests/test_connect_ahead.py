"""Decode connects ahead (services/decode/service.py): the asyncio side of a real
DecodeService against a fake producer side channel (a ZMQ ROUTER answering handshakes
the way prefill does), its engine thread replaced by a list of submitted commands. No engine,
no NIXL: what is checked is which handshakes happen, and when."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import zmq
import zmq.asyncio

from pdserve.common.engine.kv_layout import KVLayout
from pdserve.common.engine.sampling_params import SamplingParams
from pdserve.common.runtime import protocol as p
from pdserve.common.runtime.engine_commands import Command, Connected, HandshakeFailed
from pdserve.common.runtime.instance_config import InstanceAddresses
from pdserve.common.runtime.ports import free_port
from pdserve.common.runtime.service_config import DeploymentConfig
from pdserve.services.decode.service import DecodeService

LAYOUT = KVLayout(
    num_blocks=8, num_layers=2, num_kv_heads=2, block_size=4, head_dim=8, dtype="float32"
)
ENGINE = "prefill-0"


class FakeProducer:
    """Answers handshakes as PrefillService.on_handshake does, for a settable epoch."""

    def __init__(self, ctx: zmq.asyncio.Context, address: str, num_ranks: int = 1) -> None:
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.bind(address)
        self.epoch, self.num_ranks = 1, num_ranks
        self.asked: list[tuple[str, int, int]] = []  # (engine, epoch, rank) of each handshake

    def reply(self, rank: int) -> p.HandshakeReply:
        return p.HandshakeReply(
            engine_id=ENGINE, epoch=self.epoch, agent_name=f"{ENGINE}-e{self.epoch}-r{rank}",
            layout=LAYOUT, compat={}, payload=b"meta",
            pcp_rank=rank, pcp_size=self.num_ranks,
        )  # fmt: skip

    async def serve(self) -> None:
        decoder: p.Decoder[Any] = p.Decoder(p.ToSideChannel)
        while True:
            identity, frame = await self.sock.recv_multipart()
            msg = decoder.decode(frame)
            assert isinstance(msg, p.Handshake)
            self.asked.append((msg.engine_id, msg.epoch, msg.rank))
            current = (msg.engine_id, msg.epoch) in (("", 0), (ENGINE, self.epoch))
            answer = self.reply(msg.rank) if current else p.SideReply(ok=False, message="stale")
            await self.sock.send_multipart([identity, p.encode(answer)])


class Commands:
    """Stands in for the DecodeEngineThread: records what the service submits."""

    def __init__(self) -> None:
        self.submitted: list[Command] = []
        self.unreachable_producers: list[str] = []  # the thread's snapshot: none here

    def submit(self, command: Command) -> None:
        self.submitted.append(command)

    def connected(self) -> list[tuple[tuple[str, int], list[str]]]:
        return [
            (c.key, [r.agent_name for r in c.replies])
            for c in self.submitted
            if isinstance(c, Connected)
        ]


def run(num_ranks: int, scenario: Any) -> None:
    side = f"tcp://127.0.0.1:{free_port()}"
    cfg = DeploymentConfig(prefill=[InstanceAddresses(address="tcp://127.0.0.1:1", side_channel=side)],
                           decode=[InstanceAddresses(address="tcp://127.0.0.1:2")])  # fmt: skip

    async def main() -> None:
        svc = DecodeService(cfg, 0, torch_threads=1)
        svc.loop = asyncio.get_running_loop()
        svc.decode_engine = Commands()  # type: ignore[assignment]
        producer = FakeProducer(svc.ctx, side, num_ranks)
        server = asyncio.create_task(producer.serve())
        try:
            await asyncio.wait_for(scenario(svc, producer, side), 30)
        finally:
            server.cancel()
            svc.ctx.destroy(linger=0)

    asyncio.run(main())


def handle(epoch: int, num_ranks: int, side: str) -> p.KVHandle:
    replicas = [
        p.Replica(agent_name=f"{ENGINE}-e{epoch}-r{r}", side_channel=side, pcp_rank=r)
        for r in range(num_ranks)
    ]
    return p.KVHandle(engine_id=ENGINE, epoch=epoch, layout=LAYOUT, block_ids=[0], num_tokens=4,
                      replicas=replicas, lease_deadline=0.0)  # fmt: skip


def decode_request(rid: str, h: p.KVHandle) -> p.DecodeRequest:
    return p.DecodeRequest(request_id=rid, trace_id="t", prompt_token_ids=[1, 2, 3, 4],
                           sampling=SamplingParams(), first_token=5, handle=h)  # fmt: skip


def test_connects_ahead_once_per_epoch_and_again_after_a_restart() -> None:
    async def scenario(svc: DecodeService, producer: FakeProducer, side: str) -> None:
        commands: Commands = svc.decode_engine  # type: ignore[assignment]
        await svc._probe(side)
        await svc._probe(side)  # same epoch: nothing new
        assert commands.connected() == [((ENGINE, 1), [f"{ENGINE}-e1-r0"])]
        # a request of the connected epoch starts no handshake of its own
        svc.on_decode(b"router", decode_request("a", handle(1, 1, side)))
        await asyncio.sleep(0)
        assert len(producer.asked) == 2 and len(commands.connected()) == 1
        producer.epoch = 2  # the producer restarted
        await svc._probe(side)
        assert commands.connected()[-1] == ((ENGINE, 2), [f"{ENGINE}-e2-r0"])
        assert svc.metrics.value("pdserve:kv_handshakes", mode="ahead") == 2
        assert svc.metrics.value("pdserve:kv_handshakes", mode="lazy") == 0

    run(1, scenario)


def test_every_rank_of_a_pcp_producer_is_fetched_ahead() -> None:
    async def scenario(svc: DecodeService, producer: FakeProducer, side: str) -> None:
        await svc._probe(side)
        commands: Commands = svc.decode_engine  # type: ignore[assignment]
        assert commands.connected() == [((ENGINE, 1), [f"{ENGINE}-e1-r0", f"{ENGINE}-e1-r1"])]
        assert producer.asked == [("", 0, 0), (ENGINE, 1, 1)]

    run(2, scenario)


def test_a_handle_of_an_epoch_not_seen_yet_still_handshakes_lazily() -> None:
    async def scenario(svc: DecodeService, producer: FakeProducer, side: str) -> None:
        commands: Commands = svc.decode_engine  # type: ignore[assignment]
        producer.epoch = 3  # restarted since the last probe (there was none)
        svc.on_decode(b"router", decode_request("a", handle(3, 1, side)))
        await svc._handshakes[(ENGINE, 3)]
        assert commands.connected() == [((ENGINE, 3), [f"{ENGINE}-e3-r0"])]
        assert svc.metrics.value("pdserve:kv_handshakes", mode="lazy") == 1
        await svc._probe(side)  # the probe finds that epoch connected already
        assert len(commands.connected()) == 1
        # a handle of an epoch the producer no longer has: refused, the request fails
        svc.on_decode(b"router", decode_request("b", handle(2, 1, side)))
        await svc._handshakes[(ENGINE, 2)]
        failed = [c for c in commands.submitted if isinstance(c, HandshakeFailed)]
        assert failed == [HandshakeFailed(key=(ENGINE, 2), message="stale")]

    run(1, scenario)


@pytest.mark.slow
def test_the_first_request_of_a_deployment_waits_for_no_handshake(
    model_dir: Path, tmp_path: Path
) -> None:
    """A real deployment: decode connects to the prefill before any request, so the first
    request's TTFT has a zero handshake part and no lazy handshake is counted."""
    from tests.e2e import deployment

    with deployment(tmp_path / "dep", model_dir) as dep:
        deadline = time.monotonic() + 60
        while scrape(dep.url, "pdserve:kv_handshakes_total", mode="ahead") < 1:
            assert time.monotonic() < deadline, "decode never connected ahead"
            time.sleep(0.2)
        body = json.dumps({"prompt": "The capital of France is", "max_tokens": 2}).encode()
        req = urllib.request.Request(
            f"{dep.url}/v1/completions", body, {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=120) as resp:
            assert resp.status == 200
        assert scrape(dep.url, "pdserve:kv_handshakes_total", mode="lazy") == 0
        assert scrape(dep.url, "pdserve:ttft_part_seconds_count", part="handshake") == 1
        assert scrape(dep.url, "pdserve:ttft_part_seconds_sum", part="handshake") == 0.0
        assert scrape(dep.url, "pdserve:ttft_part_seconds_count", part="pull") == 1


def scrape(url: str, name: str, **labels: str) -> float:
    """Sum of the samples of ``name`` with ``labels`` on the router's /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as resp:
        text = resp.read().decode()
    return sum(
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    )
