"""The wire fuzzers' corpus: every message union with its decoder, valid frames of each
message type, and the mutations and hypothesis strategies that make garbage of them
(tests/test_fuzz_protocol.py, tests/test_fuzz_live.py)."""

from __future__ import annotations

import random

import msgspec
from hypothesis import strategies as st

from pdserve.common.engine.kv_layout import KVLayout
from pdserve.common.engine.sampling_params import SamplingParams
from pdserve.common.engine.step_plan import ScheduledSeq, StepPlan
from pdserve.common.runtime import protocol as p

UNIONS = {
    "ClientToRouter": p.ClientToRouter, "RouterToClient": p.RouterToClient,
    "RouterToPrefill": p.RouterToPrefill, "PrefillToRouter": p.PrefillToRouter,
    "RouterToDecode": p.RouterToDecode, "DecodeToRouter": p.DecodeToRouter,
    "ToSideChannel": p.ToSideChannel, "FromSideChannel": p.FromSideChannel,
}  # fmt: skip
DECODERS = {name: p.Decoder(union) for name, union in UNIONS.items()}
# Typed decoders outside the unions: the step plan broadcast to ranks, a handle alone.
OTHER_DECODERS = [msgspec.msgpack.Decoder(StepPlan), msgspec.msgpack.Decoder(p.KVHandle)]

LAYOUT = KVLayout(
    num_blocks=64, num_layers=2, num_kv_heads=2, block_size=64, head_dim=32, dtype="float32"
)
SAMPLING = SamplingParams(max_tokens=1, temperature=0.5, top_p=0.9, seed=7, stop=("x",))
HANDLE = p.KVHandle(
    engine_id="fuzz-engine", epoch=1, layout=LAYOUT, block_ids=[0, 1], num_tokens=70,
    replicas=[p.Replica(agent_name="fuzz-engine-e1-r0", side_channel="tcp://127.0.0.1:9")],
    lease_deadline=1.0,
)  # fmt: skip
# fmt: off
SAMPLES: dict[str, list[p.Message]] = {
    "ClientToRouter": [
        p.Generate(request_id="fuzz-g", prompt="The sky is", sampling=SAMPLING),
        p.Generate(prompt_token_ids=[1, 2, 3], sampling=SAMPLING, stream=False),
        p.Generate(messages=[p.ChatMessage(role="user", content="hi")], sampling=SAMPLING),
        p.Abort(request_id="fuzz-g"),
    ],
    "RouterToClient": [
        p.TokenChunk(request_id="r", trace_id="t", token_ids=[5, 6], text="ab"),
        p.Finished(request_id="r", trace_id="t", finish_reason="stop",
                   usage=p.Usage(prompt_tokens=3, completion_tokens=2)),
        p.Failed(request_id="r", reason="bad_request", message="no"),
    ],
    "RouterToPrefill": [
        p.PrefillRequest(request_id="fuzz-p", trace_id="t", prompt_token_ids=[1, 2, 3], sampling=SAMPLING),
        p.Ping(sent_at=1.5), p.MetricsQuery(), p.Abort(request_id="fuzz-p"),
    ],
    "PrefillToRouter": [
        p.PrefillDone(request_id="r", trace_id="t", first_token=4, num_cached_tokens=0, handle=HANDLE),
        p.Pong(sent_at=1.0, service="prefill", instance=0, ready=True),
        p.MetricsReport(samples=[p.MetricSample("pdserve:requests", "counter", {"a": "b"}, 1.0, [(0.1, 2.0)])]),
    ],
    "RouterToDecode": [
        p.DecodeRequest(request_id="fuzz-d", trace_id="t", prompt_token_ids=[1, 2, 3], sampling=SAMPLING),
        p.DecodeRequest(request_id="fuzz-h", trace_id="t", prompt_token_ids=[1, 2, 3], sampling=SAMPLING,
                        first_token=5, handle=HANDLE),
    ],
    "DecodeToRouter": [p.Finished(request_id="r", trace_id="t", finish_reason="length",
                                  usage=p.Usage(prompt_tokens=1, completion_tokens=1))],
    "ToSideChannel": [
        p.Handshake(engine_id="fuzz-engine", epoch=1, consumer="fuzz"),
        p.Heartbeat(engine_id="fuzz-engine", epoch=1, request_ids=["a", "b"]),
        p.Release(request_id="a", engine_id="fuzz-engine", epoch=1),
    ],
    "FromSideChannel": [
        p.HandshakeReply(engine_id="e", epoch=1, agent_name="a", layout=LAYOUT,
                         compat={"model": "m", "block_size": 64}, payload=b"\x00\x01"),
        p.SideReply(ok=False, message="stale"),
    ],
}
# fmt: on
FRAMES = [p.encode(m) for msgs in SAMPLES.values() for m in msgs]
OTHER_FRAMES = [msgspec.msgpack.encode(StepPlan(seqs=[ScheduledSeq("r", [1, 2], 0, [0], True)])),
                msgspec.msgpack.encode(HANDLE)]  # fmt: skip
MESSAGE_TYPES = sorted(
    {t for union in UNIONS.values() for t in union.__args__}, key=lambda t: t.__name__
)


def mutate(rng: random.Random, frame: bytes) -> bytes:
    """A few random edits of an encoded frame: flip, set, insert, delete bytes; truncate;
    extend; splice in a piece of another frame."""
    out = bytearray(frame)
    for _ in range(rng.randint(1, 4)):
        op = rng.randrange(7)
        at = rng.randrange(len(out) + 1)
        if op == 0 and out:
            out[min(at, len(out) - 1)] ^= 1 << rng.randrange(8)
        elif op == 1 and out:
            out[min(at, len(out) - 1)] = rng.choice(
                [0x00, 0x7F, 0x80, 0xC0, 0xC1, 0xCF, 0xD3, 0xDC, 0xDD, 0xFF]
            )
        elif op == 2:
            out[at:at] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 8)))
        elif op == 3:
            del out[at : at + rng.randint(1, 8)]
        elif op == 4:
            del out[at:]
        elif op == 5:
            out += bytes(rng.randrange(256) for _ in range(rng.randint(1, 16)))
        else:
            other = rng.choice(FRAMES)
            start = rng.randrange(len(other))
            out[at:at] = other[start : start + rng.randint(1, 24)]
    return bytes(out)


# msgpack-encodable values, nested: what a structure-aware fuzzer puts in a field
_SCALARS = (st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats()
            | st.text(max_size=12) | st.binary(max_size=12))  # fmt: skip
_VALUES = st.recursive(_SCALARS, lambda inner: st.lists(inner, max_size=4)
                       | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=12)  # fmt: skip


@st.composite
def structured(draw: st.DrawFn) -> bytes:
    """A map tagged with a real message type whose fields hold arbitrary values (past the
    msgpack layer, into validation), sometimes with a valid message's field values."""
    kind = draw(st.sampled_from(MESSAGE_TYPES))
    valid = next(
        (msgspec.to_builtins(m) for msgs in SAMPLES.values() for m in msgs if type(m) is kind), {}
    )
    fields = {}
    for name in kind.__struct_fields__:
        choice = draw(st.integers(0, 2))
        if choice == 0 and name in valid:
            fields[name] = valid[name]
        elif choice == 1:
            fields[name] = draw(_VALUES)
    return msgspec.msgpack.encode({"type": kind.__name__, **fields})


FUZZ_FRAMES = (st.binary(max_size=256) | structured()
               | st.builds(mutate, st.randoms(use_true_random=False), st.sampled_from(FRAMES)))  # fmt: skip
