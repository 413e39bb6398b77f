"""Issue 19 against one real deployment: hostile or unlucky messages and requests hurt
only themselves. Each test shows the bad one refused with a clear error, the legitimate
ones finishing, the services still running and every KV pool full afterwards. One
deployment serves the module (tests/test_faults.py's short liveness settings)."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest

from pdserve.cli.deployment import Deployment
from pdserve.common.engine.sampling_params import SamplingParams
from pdserve.common.runtime import protocol as p
from pdserve.common.runtime.curve import CurveKeys
from tests.e2e import deployment
from tests.fault_tools import Peer, pools_full, service_metrics, wait_until

pytestmark = pytest.mark.slow

FAST = {
    "ping_seconds": 0.5,
    "peer_timeout_seconds": 3.0,
    "lease_seconds": 3.0,
    "heartbeat_seconds": 0.5,
    "drain_seconds": 2.0,
}
LEASE_BOUND = 3.0 + 0.5 + 5.0
PROMPT = [1, 504, 3458, 282, 4649, 30, 13617, 28, 17212, 28]


@pytest.fixture(scope="module")
def dep(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> Iterator[Deployment]:
    # security={}: the default of `pdserve up` (internal CURVE with keys made at start)
    with deployment(tmp_path_factory.mktemp("hostile"), model_dir, security={}, **FAST) as d:
        yield d


def keys(dep: Deployment) -> CurveKeys:
    """The deployment's own client keys (what an insider, or a bug, would hold)."""
    assert dep.made_keys is not None
    return CurveKeys.client(dep.made_keys)


def roles(dep: Deployment) -> list[tuple[str, str]]:
    return [(dep.cfg.prefill_addresses[0].address, "prefill")] + [
        (dep.cfg.decode_addresses[0].address, "decode")
    ]


def client(dep: Deployment) -> Any:
    from pdserve.services.router.client import Client

    return Client(dep.cfg.front_address, timeout=120)


def still_serving(dep: Deployment) -> None:
    """Every process alive, a normal request answered, every pool back to full."""
    dep.check_alive()
    with client(dep) as c:
        assert c.generate(prompt_token_ids=PROMPT, max_tokens=4).token_ids
    wait_until(lambda: pools_full(roles(dep), keys(dep)), LEASE_BOUND, "every KV pool to be full")


def bad_messages(dep: Deployment, address: str, role: str) -> float:
    return service_metrics(address, role, keys(dep))["pdserve:bad_messages"]


def test_malformed_decode_requests_are_refused_and_decode_lives(dep: Deployment) -> None:
    """Issue item 1: replicas=[] or first_token=None ended decode's engine thread."""
    with Peer(dep.cfg.prefill_addresses[0].address, "prefill", keys(dep)) as pre:
        done = pre.ask(
            p.PrefillRequest(
                request_id="h1", trace_id="h1", prompt_token_ids=PROMPT, sampling=SamplingParams()
            )
        )[-1]
    assert isinstance(done, p.PrefillDone), done
    handle = done.handle
    good = p.DecodeRequest(
        request_id="h1",
        trace_id="h1",
        prompt_token_ids=PROMPT,
        sampling=SamplingParams(max_tokens=4),
        first_token=done.first_token,
        handle=handle,
    )
    forged = {
        "names no replica": msgspec.structs.replace(
            good, handle=msgspec.structs.replace(handle, replicas=[])
        ),
        "must carry the first token": msgspec.structs.replace(good, first_token=None),
        "outside the producer's pool": msgspec.structs.replace(
            good,
            handle=msgspec.structs.replace(
                handle, block_ids=[handle.layout.num_blocks + 5] * len(handle.block_ids)
            ),
        ),
        "outside the vocabulary": msgspec.structs.replace(good, first_token=10**9),
        "characters, more than": msgspec.structs.replace(good, request_id="x" * 100_000),
    }
    address = dep.cfg.decode_addresses[0].address
    before = bad_messages(dep, address, "decode")
    with Peer(address, "decode", keys(dep)) as peer:
        for words, msg in forged.items():
            peer.send(msg)
            reply = wait_until(lambda: peer.sock.poll(100) and peer.decoder.decode(peer.sock.recv()),
                               10, f"the answer to {words!r}")  # fmt: skip
            assert isinstance(reply, p.Failed) and reply.reason == "bad_request", reply
            assert words in reply.message, (words, reply)
        # The genuine request with the same id still decodes: nothing of the forged ones stayed.
        replies = peer.ask(good)
    assert isinstance(replies[-1], p.Finished), replies[-1]
    assert bad_messages(dep, address, "decode") == before + len(forged)
    still_serving(dep)


def test_a_tiny_temperature_is_greedy_and_poisons_no_batch(dep: Deployment) -> None:
    """Issue item 5: temperature 1e-40 made the step's probabilities NaN and failed every
    request of that step with 500."""
    with client(dep) as c:
        greedy = c.generate(prompt_token_ids=PROMPT, max_tokens=6, ignore_eos=True).token_ids

    def run(temperature: float, k: int) -> list[int]:
        with client(dep) as c:
            ids = PROMPT if k == 0 else PROMPT + [k]
            result = c.generate(
                prompt_token_ids=ids, max_tokens=6, temperature=temperature, ignore_eos=True
            )
            return list(result.token_ids)

    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        tiny = pool.submit(run, 1e-40, 0)
        others = [pool.submit(run, 0.8, k) for k in range(1, 6)]
        assert tiny.result(timeout=120) == greedy
        assert all(len(f.result(timeout=120)) == 6 for f in others)
    still_serving(dep)


def test_internal_sockets_need_the_deployment_key_by_default(dep: Deployment) -> None:
    """Issue item 2: with nothing configured any local process reached prefill and decode
    (a forged PrefillRequest was served, an Abort cut a user's stream). Now `up` makes a
    key pair in a private directory; a peer without it gets nothing, is counted, and the
    services keep serving."""
    assert dep.made_keys is not None
    assert dep.made_keys.stat().st_mode & 0o777 == 0o700
    assert (dep.made_keys / "client.key_secret").stat().st_mode & 0o077 == 0
    stranger_keys = CurveKeys.client(dep.made_keys)  # the right server key, a wrong client pair
    import zmq.auth

    other = dep.made_keys.parent / f"{dep.made_keys.name}-stranger"
    other.mkdir(mode=0o700)
    try:
        public, secret = zmq.auth.load_certificate(zmq.auth.create_certificates(other, "x")[1])
        assert secret is not None
        stranger_keys = CurveKeys(public_key=public, secret_key=secret,
                                  server_key=stranger_keys.server_key)  # fmt: skip
        forged = p.PrefillRequest(
            request_id="forged",
            trace_id="forged",
            prompt_token_ids=PROMPT,
            sampling=SamplingParams(),
        )
        for address, role in roles(dep):
            for curve in (None, stranger_keys):  # no CURVE at all; an unknown key
                with Peer(address, role, curve) as peer:
                    peer.send(forged if role == "prefill" else p.MetricsQuery())
                    assert not peer.sock.poll(1500), f"{role} answered a peer without the key"
    finally:
        import shutil

        shutil.rmtree(other, ignore_errors=True)
    m = service_metrics(dep.cfg.prefill_addresses[0].address, "prefill", keys(dep))
    assert m["pdserve:auth_failures"] >= 1
    still_serving(dep)
