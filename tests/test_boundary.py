"""The boundary's semantic checks (common/runtime/boundary.py) and a sampler whose one
bad row never poisons its batch (issue 19, items 1 and 5). Deployments: test_hostile.py."""

from __future__ import annotations

import subprocess

import msgspec
import torch

from pdserve.common.engine.kv_layout import KVLayout
from pdserve.common.engine.sampling import FAILED_TOKEN, Sampler, SamplingParams
from pdserve.common.runtime import boundary as b
from pdserve.common.runtime import protocol as p

LIMITS = b.Limits(vocab_size=100, max_model_len=64, num_ranks=2)
LAYOUT = KVLayout(
    num_blocks=8, num_layers=2, num_kv_heads=1, block_size=4, head_dim=8, dtype="float32"
)
PROMPT = [1, 2, 3, 4, 5, 6]  # 2 blocks of 4


def handle(**kw: object) -> p.KVHandle:
    base = p.KVHandle(
        engine_id="prefill-0",
        epoch=1,
        layout=LAYOUT,
        block_ids=[3, 4],
        num_tokens=len(PROMPT),
        replicas=[p.Replica(agent_name="a-r0", side_channel="tcp://127.0.0.1:1")],
        lease_deadline=0.0,
    )
    return msgspec.structs.replace(base, **kw)


def decode(**kw: object) -> p.DecodeRequest:
    base = p.DecodeRequest(
        request_id="r",
        trace_id="t",
        prompt_token_ids=PROMPT,
        sampling=SamplingParams(),
        first_token=7,
        handle=handle(),
    )
    return msgspec.structs.replace(base, **kw)


def test_a_sound_decode_request_passes() -> None:
    assert b.check(decode(), LIMITS) is None
    assert b.check(decode(handle=None, first_token=None), LIMITS) is None  # colocated


def test_each_broken_decode_request_is_named() -> None:
    cases = {
        "names no replica": decode(handle=handle(replicas=[])),
        "first token prefill sampled": decode(first_token=None),
        "first token 100 is outside": decode(first_token=100),
        "block id -1 is negative": decode(handle=handle(block_ids=[3, -1])),
        "lists a block twice": decode(handle=handle(block_ids=[3, 3])),
        "lists 3 blocks": decode(handle=handle(block_ids=[1, 2, 3])),
        "holds 9 tokens": decode(handle=handle(num_tokens=9)),
        "token id 100 is outside": decode(prompt_token_ids=[1, 100]),
        "prompt is empty": decode(prompt_token_ids=[], handle=None),
        "more than max_model_len": decode(prompt_token_ids=[1] * 65, handle=None),
        "request_id has 300": decode(request_id="x" * 300),
        "repeats a replica": decode(
            handle=handle(replicas=[handle().replicas[0], handle().replicas[0]])
        ),
        "temperature": decode(sampling=SamplingParams(temperature=float("nan"))),
        "num_cached_tokens": decode(num_cached_tokens=7),
    }
    for words, msg in cases.items():
        problem = b.check(msg, LIMITS)
        assert problem is not None and words in problem, (words, problem)


def test_without_limits_the_model_free_checks_still_run() -> None:
    assert "names no replica" in (b.check(decode(handle=handle(replicas=[])), None) or "")
    assert "first token" in (b.check(decode(first_token=None), None) or "")
    assert b.check(decode(prompt_token_ids=PROMPT), None) is None


def test_side_channel_messages() -> None:
    release = p.Release(request_id="r", engine_id="prefill-0", epoch=1, rank=2)
    assert "ranks 0..1" in (b.check(release, LIMITS) or "")
    assert b.check(msgspec.structs.replace(release, rank=1), LIMITS) is None
    beat = p.Heartbeat(engine_id="e", epoch=1, request_ids=["r"] * (b.MAX_HEARTBEAT_IDS + 1))
    assert "heartbeat names" in (b.check(beat, LIMITS) or "")


def test_prefill_request_checks() -> None:
    ok = p.PrefillRequest(
        request_id="r", trace_id="t", prompt_token_ids=PROMPT, sampling=SamplingParams()
    )
    assert b.check(ok, LIMITS) is None
    bad = msgspec.structs.replace(ok, prompt_token_ids=[-1])
    assert "token id -1" in (b.check(bad, LIMITS) or "")


# -- sampling ---------------------------------------------------------------------------


def test_a_temperature_below_epsilon_is_greedy() -> None:
    logits = torch.randn(3, 50) * 30
    params = [SamplingParams(temperature=t) for t in (1e-40, 1e-6, 0.0)]
    sampler = Sampler()
    assert sampler(logits, params, [0, 0, 0]) == logits.argmax(-1).tolist()
    assert sampler.failed_rows == {}


def test_a_nan_row_fails_alone() -> None:
    logits = torch.randn(4, 50)
    logits[1] = float("nan")  # sampled: multinomial would raise for the whole batch
    logits[2] = float("nan")  # greedy: argmax would return a meaningless id
    params = [
        SamplingParams(temperature=0.7, seed=1),
        SamplingParams(temperature=0.7, seed=2),
        SamplingParams(),
        SamplingParams(),
    ]
    sampler = Sampler()
    tokens = sampler(logits, params, [0] * 4)
    assert set(sampler.failed_rows) == {1, 2}
    assert "not finite" in sampler.failed_rows[1] and "NaN" in sampler.failed_rows[2]
    assert tokens[1] == tokens[2] == FAILED_TOKEN
    alone = Sampler()(logits[0:1], params[0:1], [0])[0]
    assert tokens[0] == alone and tokens[3] == int(logits[3].argmax())


def test_the_interface_of_an_address() -> None:
    from pdserve.common.runtime.net_scope import host_of, interface_of

    assert host_of("tcp://127.0.0.1:5601") == "127.0.0.1"
    assert interface_of("127.0.0.1") == "lo"
    assert interface_of("0.0.0.0") is None  # every interface: left to the operator
    assert interface_of("example.invalid") is None
    out = subprocess.run(["ip", "-4", "-o", "addr"], capture_output=True, text=True).stdout
    for line in out.splitlines():  # "2: eth0    inet 192.0.2.2/24 ...": every address found
        name, ip = line.split()[1], line.split()[3].split("/")[0]
        assert interface_of(ip) == name, line
