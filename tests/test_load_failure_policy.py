"""kv_load_failure_policy on a real decode service: a handle whose producer cannot be
reached (its side channel is silent) fails the request, or is recomputed locally."""

from __future__ import annotations

from pathlib import Path

import pytest
import zmq

from pdserve.common.engine.config import EngineConfig
from pdserve.common.engine.kv_layout import KVLayout
from pdserve.common.engine.llm_engine import LLMEngine
from pdserve.common.engine.sampling_params import SamplingParams
from pdserve.common.runtime import protocol as p
from tests.e2e import deployment, free_port_block
from tests.fault_tools import service_metrics

pytestmark = pytest.mark.slow


def ask_decode(address: str, msg: p.DecodeRequest, timeout_s: float = 60.0) -> list[p.Message]:
    """Send one DecodeRequest straight to a decode service; collect its replies."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    sock.send(p.encode(msg))
    decoder: p.Decoder[p.Message] = p.Decoder(p.DecodeToRouter)
    replies: list[p.Message] = []
    try:
        while sock.poll(timeout_s * 1000):
            reply = decoder.decode(sock.recv())
            if isinstance(reply, p.Pong | p.MetricsReport):
                continue
            replies.append(reply)
            if isinstance(reply, p.Finished | p.Failed):
                break
    finally:
        sock.close()
        ctx.term()
    return replies


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_unreachable_producer_follows_the_policy(
    tmp_path: Path, model_dir: Path, policy: str
) -> None:
    mono = LLMEngine(EngineConfig(model=str(model_dir), kv_cache_memory_gb=0.1))
    prompt = mono.tokenizer.encode("The days of the week are Monday, Tuesday,")
    want = mono.generate([prompt], SamplingParams(max_tokens=6))[0].token_ids
    silent = f"tcp://127.0.0.1:{free_port_block(1)}"  # nobody answers the handshake there
    layout = KVLayout(
        num_blocks=8, num_layers=30, num_kv_heads=3, block_size=64, head_dim=64, dtype="float32"
    )
    handle = p.KVHandle(
        engine_id="prefill-gone",
        epoch=1,
        layout=layout,
        block_ids=[0],
        num_tokens=len(prompt),
        replicas=[p.Replica(agent_name="prefill-gone-e1-r0", side_channel=silent)],
        lease_deadline=0.0,
    )
    msg = p.DecodeRequest(
        request_id="r1",
        trace_id="t1",
        prompt_token_ids=prompt,
        sampling=SamplingParams(max_tokens=6),
        first_token=want[0],
        handle=handle,
    )
    with deployment(tmp_path, model_dir, colocated=True, kv_load_failure_policy=policy) as dep:
        replies = ask_decode(dep.cfg.decode_addresses[0].address, msg)
        failures = service_metrics(dep.cfg.decode_addresses[0].address, "decode")[
            "pdserve:kv_transfer_failures"
        ]
    terminal = replies[-1]
    assert (
        failures == 1
    )  # counted whatever the policy (tests/test_faults.py: dead and lying producers)
    if policy == "fail":
        assert isinstance(terminal, p.Failed) and terminal.reason == "kv_transfer"
        assert "prefill-gone" in terminal.message
    else:
        assert isinstance(terminal, p.Finished)
        got = [t for r in replies if isinstance(r, p.TokenChunk) for t in r.token_ids]
        assert got == want
