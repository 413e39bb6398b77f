"""pdserve across hosts (issue #41): the router, two prefill and two decode instances each on
a host of its own (Linux network namespaces on one bridge, tests/netns_hosts.py), started
as the systemd units start them, CURVE on, NIXL over UCX's TCP transport. The happy path
first; then faults between hosts under load: a partition between a prefill and the decode
hosts mid-pull, the router cut off from a decode host, SIGSTOP and SIGKILL of a service,
and an abort storm. Each checks that every accepted request got one terminal answer within
its deadline, that the pools are back at their idle counts, that the healthy side serves
meanwhile and keeps its systemd watchdog (every service runs with a notify socket the test
reads and a watchdog timeout, as its unit's WatchdogSec sets) and that the separated
instance rejoins without a restart. The figures go into
docs/operations.md ("Across hosts").
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pdserve.common.engine.config import EngineConfig
from pdserve.common.engine.llm_engine import LLMEngine
from pdserve.common.engine.sampling_params import SamplingParams
from pdserve.common.runtime import protocol as p
from pdserve.common.runtime.fault_hooks import HOLD_PULLS_ENV
from pdserve.common.runtime.service_config import DeploymentConfig
from pdserve.services.decode.service import CONNECT_AHEAD_SECONDS, HANDSHAKE_TIMEOUT
from tests.fault_suite import FAST, LEASE, PEER_TIMEOUT, SLACK
from tests.fault_tools import wait_until
from tests.multihost import MultiHost, abort_and_collect, raw_requests
from tests.netns_hosts import Lab, unavailable
from tests.sd_listener import NotifyListener

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(unavailable() is not None, reason=f"{unavailable()}"),
]

READY_TIMEOUT = 180.0
DECODES = ("decode-0", "decode-1")
SERVICES = ("router", "prefill-0", "prefill-1", *DECODES)
UNITS = Path(__file__).resolve().parents[1] / "deploy" / "systemd"
# WATCHDOG_USEC the services get: shorter than the units' WatchdogSec (30 s) as the
# liveness settings are shorter than their defaults, so that each fault case's window (the
# few seconds from the fault to the pools idle) holds several pings (due every 1.5 s); a
# service silent for longer would be killed by systemd with this setting.
WATCHDOG_SECONDS = 3.0
STREAM_TOKENS = 250  # the steady streams of the fault cases: still running when hit
DEADLINE = 20.0  # the router's first-token deadline here: every request ends within it
SETTINGS: dict[str, Any] = {
    **FAST,
    "kv_load_failure_policy": "fail",  # decode-1 overrides it: recompute (its env file)
    "first_token_timeout_seconds": DEADLINE,
    "ucx": {"UCX_TLS": "tcp"},  # UCX_TCP_USER_TIMEOUT derived: (3 s - 0.5 s) / 2
    "engine": {"kv_cache_memory_gb": 0.25},
    "max_dispatched_requests": 1100,  # the abort storm's 1,000 all reach the decodes
}
if "local_prefill_threshold" in DeploymentConfig.__struct_fields__:
    SETTINGS["local_prefill_threshold"] = 0  # every prompt crosses hosts through a prefill


def prompts(tokenizer: Any) -> list[list[int]]:
    texts = [
        "The days of the week are Monday, Tuesday,",
        "Once upon a time, in a land far away, there lived",
        "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
        " ".join(f"item {i}," for i in range(40)),  # more than one KV block
    ]
    return [tokenizer.encode(t) for t in texts]


@pytest.fixture(scope="module")
def hold_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("hold") / "hold-pulls"


@pytest.fixture(scope="module")
def hosts(
    tmp_path_factory: pytest.TempPathFactory, model_dir: Path, hold_path: Path
) -> Iterator[MultiHost]:
    work = tmp_path_factory.mktemp("multihost")
    held = {HOLD_PULLS_ENV: str(hold_path)}
    env = {"decode-0": held, "decode-1": {**held, "PDSERVE_KV_LOAD_FAILURE_POLICY": "recompute"}}
    # A short directory: an AF_UNIX path holds 107 bytes at most.
    with tempfile.TemporaryDirectory(prefix="pdsd") as notify_dir, Lab() as lab:
        systemd = NotifyListener(Path(notify_dir), SERVICES, WATCHDOG_SECONDS)
        dep = None
        try:
            dep = MultiHost(lab, work, model_dir, 2, 2, SETTINGS, env, systemd)
            dep.start()
            dep.wait_ready(READY_TIMEOUT)
            yield dep
        finally:
            systemd.close()
            if dep is not None:
                dep.ctx.destroy(linger=0)


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> tuple[list[list[int]], list[list[int]]]:
    """The prompts and their greedy tokens from the monolithic engine in this process."""
    mono = LLMEngine(EngineConfig(model=str(model_dir), kv_cache_memory_gb=0.1))
    ids = prompts(mono.tokenizer)
    outs = mono.generate(ids, SamplingParams(max_tokens=8))
    return ids, [o.token_ids for o in outs]


def counter(text: str, name: str, **labels: str) -> float:
    """Sum of a /metrics counter's samples whose labels include ``labels``."""
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name):
            continue
        head, _, value = line.rpartition(" ")
        if all(f'{k}="{v}"' in head for k, v in labels.items()):
            total += float(value)
    return total


def watchdog_kept(hosts: MultiHost, since: float, services: tuple[str, ...] = SERVICES) -> str:
    """Every one of ``services`` sent WATCHDOG=1 within WATCHDOG_SECONDS of the last one
    at every moment since ``since`` (systemd would have killed it otherwise); returns the
    longest silences for the case's printout."""
    assert hosts.systemd is not None
    end = time.monotonic()
    silences = {s: hosts.systemd.longest_silence(s, since, end) for s in services}
    assert max(silences.values()) <= WATCHDOG_SECONDS, silences
    return f"longest watchdog silence over {end - since:.1f} s: " + ", ".join(
        f"{s} {v:.2f} s" for s, v in silences.items()
    )


def test_greedy_across_hosts_is_the_monolithic_engines(
    hosts: MultiHost, reference: tuple[list[list[int]], list[list[int]]]
) -> None:
    ids, want = reference
    before = hosts.metrics_text()
    futures = [hosts.submit(p, max_tokens=8) for p in ids * 3]
    results = [f.result(timeout=120) for f in futures]
    assert [r.token_ids for r in results] == want * 3
    after = hosts.metrics_text()
    # Every instance served: a prefill's KV was released by a decode on another host, a
    # decode pulled KV.
    for role, name in (("prefill", "pdserve:kv_replica_releases_total"),
                       ("decode", "pdserve:kv_transfers_total")):  # fmt: skip
        for i in range(2):
            now = counter(after, name, service=role, instance=str(i))
            assert now > counter(before, name, service=role, instance=str(i)), (role, i)
    pulled = counter(after, "pdserve:kv_transfer_bytes_total") - counter(
        before, "pdserve:kv_transfer_bytes_total"
    )
    print(f"KV pulled over UCX TCP: {pulled:.0f} bytes for {len(futures)} requests")
    assert pulled > 0
    wait_until(hosts.pools_idle, SLACK, "every pool back at its idle count")


def test_prefix_hits_are_routed_to_the_prefill_that_holds_them(hosts: MultiHost) -> None:
    base = list(range(1000, 1000 + 200))  # three full blocks shared
    first = hosts.generate(base + [7, 8, 9], max_tokens=2)
    again = hosts.generate(base + [10, 11], max_tokens=2)
    assert not isinstance(first, Exception) and not isinstance(again, Exception)
    assert again.usage.cached_tokens >= 192, again.usage


def test_ucx_and_bind_settings_reached_the_services(hosts: MultiHost) -> None:
    """decode-1 binds every interface and advertises its address (the router reaches it
    there); decode-0 binds its address only; NIXL's UCX ran TCP."""
    log = hosts.log_path("decode-1").read_text()
    assert '"UCX_TLS": "tcp"' in log, log[-2000:]

    def listening(host: str) -> str:
        netns = hosts.lab.hosts[host].netns
        return subprocess.run(["ip", "netns", "exec", netns, "ss", "-ltnH"],
                              capture_output=True, text=True, check=True).stdout  # fmt: skip

    assert "0.0.0.0:5620" in listening("decode1")
    assert f"{hosts.lab.hosts['decode0'].ip}:5620" in listening("decode0")
    status, detail = hosts.health()
    assert status == 200, detail


def test_every_service_notified_ready_and_pings_its_watchdog(hosts: MultiHost) -> None:
    """As a Type=notify unit with WatchdogSec: one READY=1 once serving, then WATCHDOG=1
    within every timeout through the cases above (WATCHDOG_PID named each service's own
    pid, so none ignored it)."""
    assert hosts.systemd is not None
    notify = [u for u in UNITS.glob("pdserve-*.service") if "Type=notify" in u.read_text()]
    assert len(notify) >= 3  # router, prefill, decode (pdserve-mps.service forks a daemon)
    for unit in notify:
        found = re.search(r"^WatchdogSec=(\d+)s$", unit.read_text(), re.MULTILINE)
        assert found and WATCHDOG_SECONDS <= int(found.group(1)), unit
    for service in SERVICES:
        ready = hosts.systemd.times(service, "READY=1")
        assert len(ready) == 1, (service, ready)
        assert hosts.systemd.times(service, "WATCHDOG=1"), service
    print("\n" + watchdog_kept(hosts, max(hosts.systemd.times(s, "READY=1")[0] for s in SERVICES)))


@pytest.fixture
def hold(hold_path: Path) -> Iterator[Path]:
    """While this file exists, decode starts no pull (HOLD_PULLS_ENV); never left behind."""
    yield hold_path
    hold_path.unlink(missing_ok=True)


def held_at_decode(hosts: MultiHost) -> int:
    return int(sum(hosts.service_metrics(f"decode-{i}")["pdserve:num_requests_waiting"]
                   for i in range(2)))  # fmt: skip


def outcome(result: Any) -> str:
    if isinstance(result, Exception):
        return f"{getattr(result, 'reason', type(result).__name__)}"
    return "tokens"


def check_answers(
    results: list[Any], sent: list[list[int]], ids: list[list[int]], want: list[list[int]]
) -> dict[str, int]:
    """Each request's one answer: tokens identical to the reference, or an error naming its
    cause; returns the count of each outcome."""
    counts: dict[str, int] = {}
    for prompt, result in zip(sent, results, strict=True):
        kind = outcome(result)
        counts[kind] = counts.get(kind, 0) + 1
        if kind == "tokens":
            assert result.token_ids == want[ids.index(prompt)]
        else:
            assert str(result), result  # a message a user can act on
    return counts


def unreachable_reported(hosts: MultiHost) -> dict[str, float]:
    """Prefills each decode reports it cannot pull from, as the router last heard (its
    pdserve:unreachable_producers gauge)."""
    text = hosts.metrics_text()
    return {d: counter(text, "pdserve:unreachable_producers", peer=d) for d in DECODES}


def releases(hosts: MultiHost, prefill: str) -> float:
    return hosts.service_metrics(prefill).get("pdserve:kv_replica_releases", 0.0)


def test_partition_between_a_prefill_and_the_decodes_mid_pull(
    hosts: MultiHost, hold: Path, reference: tuple[list[list[int]], list[list[int]]]
) -> None:
    """prefill0 cut from both decode hosts while their pulls from it start: the READs fail
    within UCX_TCP_USER_TIMEOUT (before prefill-0's leases could end), decode-0 (policy
    fail) fails them naming prefill-0 and counts them, decode-1 (recompute) recomputes them.
    Each decode then reports prefill-0 unreachable in its Pongs (once a pull of its own
    failed: routing decides which decodes tried it) and the router, which still reaches
    every instance, sends new requests through prefill-1: all served with tokens, none
    failed or recomputed."""
    ids, want = reference
    names = ("decode-0", "decode-1", "prefill-0", "prefill-1")
    before = {d: hosts.service_metrics(d) for d in names}
    hold.touch()
    sent = [ids[i % len(ids)] for i in range(8)]
    futures = [hosts.submit(prompt, max_tokens=8) for prompt in sent]
    wait_until(lambda: held_at_decode(hosts) == len(sent), 30, "the requests held at decode")
    hosts.lab.cut("prefill0", "decode0")
    hosts.lab.cut("prefill0", "decode1")
    cut_at = time.monotonic()
    hold.unlink()
    results = [f.result(timeout=DEADLINE + SLACK) for f in futures]
    answered_in = time.monotonic() - cut_at
    learning: list[Any] = []  # requests sent until both decodes report prefill-0

    def learned() -> bool:
        if all(unreachable_reported(hosts).values()):
            return True
        learning.extend(f.result(timeout=DEADLINE)
                        for f in [hosts.submit(x, max_tokens=8) for x in ids])  # fmt: skip
        return False

    wait_until(learned, 2 * DEADLINE + SLACK, "both decodes report prefill-0 unreachable", 0.2)
    learned_in = time.monotonic() - cut_at
    assert hosts.health()[0] == 200  # the router reaches every instance
    counts = check_answers(results + learning, sent + ids * (len(learning) // len(ids)), ids, want)
    mid = {d: hosts.service_metrics(d) for d in names}
    delta = {d: {k: mid[d][k] - before[d].get(k, 0.0) for k in mid[d]} for d in names}
    failed_fail = delta["decode-0"]["pdserve:kv_transfer_failures"]
    failed_recompute = delta["decode-1"]["pdserve:kv_transfer_failures"]
    # Policy fail: every failed pull is a failed request (none silently recomputed);
    # policy recompute: none is.
    assert counts.get("kv_transfer", 0) == failed_fail
    assert failed_fail + failed_recompute >= 1
    # The router knows: every new request through prefill-1, served with tokens.
    during = [f.result(timeout=DEADLINE) for f in [hosts.submit(x, max_tokens=8) for x in sent]]
    assert check_answers(during, sent, ids, want) == {"tokens": len(sent)}
    for d in DECODES:
        assert (
            hosts.service_metrics(d)["pdserve:kv_transfer_failures"]
            == (mid[d]["pdserve:kv_transfer_failures"])
        ), d  # none failed (decode-0) or recomputed (decode-1)
    wait_until(lambda: releases(hosts, "prefill-1")
               >= mid["prefill-1"].get("pdserve:kv_replica_releases", 0.0) + len(sent),
               SLACK, "prefill-1 released every request served during the partition")  # fmt: skip
    hosts.lab.heal("prefill0", "decode0")
    hosts.lab.heal("prefill0", "decode1")
    healed_at = time.monotonic()
    wait_until(hosts.pools_idle, LEASE + SLACK, "every pool back at its idle count")
    idle_in = time.monotonic() - healed_at
    kept = watchdog_kept(hosts, cut_at)  # the separated prefill's too: it is not stopped
    print(f"\npartition: {len(sent)} held + {len(learning)} before both decodes reported "
          f"prefill-0 ({learned_in:.2f} s after the cut): {counts}; decode-0 (fail) failed "
          f"{failed_fail:g}, decode-1 (recompute) recomputed {failed_recompute:g}; held ones "
          f"answered in {answered_in:.2f} s; then {len(during)} of {len(during)} served "
          f"through prefill-1; pools idle {idle_in:.2f} s after the heal; {kept}")  # fmt: skip


def test_the_separated_prefill_rejoins_after_the_heal(
    hosts: MultiHost, reference: tuple[list[list[int]], list[list[int]]]
) -> None:
    """After the partition above healed, prefill-0 serves both decodes again without a
    restart: each decode's connect ahead reaches its side channel again (a probe that was
    waiting when the heal came times out first: HANDSHAKE_TIMEOUT), loads its NIXL
    metadata again and stops reporting it; the router then routes through it again."""
    ids, want = reference
    healed_at = time.monotonic()
    bound = 2 * HANDSHAKE_TIMEOUT + CONNECT_AHEAD_SECONDS + SLACK
    wait_until(lambda: not any(unreachable_reported(hosts).values()), bound,
               "no decode reports prefill-0 unreachable", 0.5)  # fmt: skip
    rejoined_in = time.monotonic() - healed_at
    before = releases(hosts, "prefill-0")
    sent = [ids[i % len(ids)] for i in range(8)]
    results = [f.result(timeout=DEADLINE) for f in [hosts.submit(x, max_tokens=8) for x in sent]]
    assert check_answers(results, sent, ids, want) == {"tokens": 8}
    wait_until(lambda: releases(hosts, "prefill-0") > before, SLACK, "prefill-0 used again")
    wait_until(hosts.pools_idle, SLACK, "every pool idle after the rejoin")
    print(f"\nrejoin: no decode reports prefill-0 {rejoined_in:.2f} s into this test")


def test_router_cut_off_from_a_decode_host(
    hosts: MultiHost, reference: tuple[list[list[int]], list[list[int]]]
) -> None:
    """Streams in flight on decode-1 when its host loses the router fail peer_down within
    the peer timeout; decode-0's finish; /health names decode-1 and new requests are served
    by decode-0; after the heal decode-1 is ready again without a restart."""
    ids, want = reference
    long = [
        hosts.submit(ids[i % len(ids)], max_tokens=STREAM_TOKENS, ignore_eos=True) for i in range(6)
    ]
    wait_until(lambda: all(hosts.service_metrics(f"decode-{i}")["pdserve:num_requests_running"]
                           for i in range(2)), 30, "streams on both decodes")  # fmt: skip
    hosts.lab.cut("router", "decode1")
    cut_at = time.monotonic()
    results = [f.result(timeout=PEER_TIMEOUT + DEADLINE + SLACK) for f in long]
    answered_in = time.monotonic() - cut_at
    kinds = [outcome(r) for r in results]
    assert set(kinds) <= {"tokens", "peer_down"} and "peer_down" in kinds, kinds
    status, detail = hosts.health()
    assert status == 503 and "decode" in json.dumps(detail), detail
    during = [hosts.generate(prompt, max_tokens=8) for prompt in ids]
    assert check_answers(during, ids, ids, want) == {"tokens": len(ids)}
    hosts.lab.heal("router", "decode1")
    healed_at = time.monotonic()
    wait_until(lambda: hosts.health()[0] == 200, PEER_TIMEOUT + SLACK, "decode-1 back in /health")
    back_in = time.monotonic() - healed_at
    wait_until(hosts.pools_idle, LEASE + SLACK, "every pool back at its idle count")
    kept = watchdog_kept(hosts, cut_at)  # decode-1's too: cut off, not stopped
    print(f"\nrouter cut from decode1: {kinds.count('peer_down')} of {len(kinds)} streams "
          f"peer_down, all answered in {answered_in:.2f} s; {len(ids)} new requests served "
          f"during the cut; ready again {back_in:.2f} s after the heal; {kept}")  # fmt: skip


@pytest.mark.parametrize(
    "sig",
    [signal.SIGSTOP, signal.SIGKILL],
    ids=["sigstop", "sigkill"],
)
def test_a_decode_stopped_or_killed_on_its_host(
    hosts: MultiHost, reference: tuple[list[list[int]], list[list[int]]], sig: signal.Signals
) -> None:
    """Streams on decode-1 fail peer_down (SIGKILL: its connection drops; SIGSTOP: silent
    past the peer timeout), decode-0's finish and it serves new requests; decode-1 comes
    back (SIGCONT, or started again as systemd's Restart= does) and /health is 200 again."""
    ids, want = reference
    assert hosts.systemd is not None
    readies = len(hosts.systemd.times("decode-1", "READY=1"))
    long = [
        hosts.submit(ids[i % len(ids)], max_tokens=STREAM_TOKENS, ignore_eos=True) for i in range(6)
    ]
    wait_until(lambda: all(hosts.service_metrics(f"decode-{i}")["pdserve:num_requests_running"]
                           for i in range(2)), 30, "streams on both decodes")  # fmt: skip
    hosts.signal("decode-1", sig)
    hit_at = time.monotonic()
    results = [f.result(timeout=PEER_TIMEOUT + DEADLINE + SLACK) for f in long]
    answered_in = time.monotonic() - hit_at
    kinds = [outcome(r) for r in results]
    assert set(kinds) <= {"tokens", "peer_down"} and "peer_down" in kinds, kinds
    during = [hosts.generate(prompt, max_tokens=8) for prompt in ids]
    assert check_answers(during, ids, ids, want) == {"tokens": len(ids)}
    if sig == signal.SIGSTOP:
        hosts.signal("decode-1", signal.SIGCONT)
    else:
        hosts.procs["decode-1"].wait(10)
        hosts.start("decode-1")
    back_at = time.monotonic()
    hosts.wait_ready(READY_TIMEOUT)
    back_in = time.monotonic() - back_at
    wait_until(hosts.pools_idle, LEASE + SLACK, "every pool back at its idle count")
    kept = watchdog_kept(hosts, hit_at, tuple(s for s in SERVICES if s != "decode-1"))
    # decode-1 itself: its watchdog pings again after SIGCONT; started again, it sent
    # READY=1 again.
    assert len(hosts.systemd.times("decode-1", "READY=1")) == readies + (sig == signal.SIGKILL)
    wait_until(lambda: max(hosts.systemd.times("decode-1", "WATCHDOG=1")) > back_at,
               WATCHDOG_SECONDS, "decode-1's watchdog pinged again")  # fmt: skip
    print(f"\n{sig.name} decode-1: {kinds.count('peer_down')} of {len(kinds)} streams peer_down, "
          f"all answered in {answered_in:.2f} s; {len(ids)} served meanwhile; ready again "
          f"{back_in:.2f} s after SIGCONT / restart; {kept}")  # fmt: skip


STORM_CLIENTS, STORM_PER_CLIENT = 4, 250  # the 1,000 aborts (256 a client at most)


def rate(hosts: MultiHost, ids: list[list[int]], num: int = 16) -> float:
    """Requests a second of ``num`` short requests sent at once."""
    started = time.monotonic()
    results = [f.result(timeout=DEADLINE) for f in [hosts.submit(ids[i % 3], max_tokens=8)
                                                    for i in range(num)]]  # fmt: skip
    assert all(outcome(r) == "tokens" for r in results), results
    return num / (time.monotonic() - started)


def test_an_abort_storm_while_pulls_wait_and_start(
    hosts: MultiHost, hold: Path, reference: tuple[list[list[int]], list[list[int]]]
) -> None:
    """1,000 requests prefilled and waiting at the decodes for their pulls (held), then
    the pulls let go and all 1,000 aborted at once: each gets exactly one terminal reply,
    nothing after it; every pool is back at its idle count within the issue's 5 s of the
    last abort; requests after the storm are served at the rate before it (within 2x)."""
    ids, _ = reference
    before = rate(hosts, ids)
    hold.touch()
    num = STORM_CLIENTS * STORM_PER_CLIENT
    ctx, socks, frames = hosts.call(raw_requests, hosts, ids[:3], STORM_PER_CLIENT, STORM_CLIENTS)
    wait_until(lambda: held_at_decode(hosts) == num, 120, f"{num} requests held at decode")
    hold.unlink()  # pulls start while the aborts arrive
    sent_at = hosts.call(abort_and_collect, ctx, socks, frames, STORM_PER_CLIENT, 60.0)
    wait_until(hosts.pools_idle, 30, "every pool back at its idle count")
    idle_in = time.monotonic() - sent_at
    bad = [(k, [type(f).__name__ for f in v]) for k, v in frames.items()
           if sum(isinstance(f, p.Finished | p.Failed) for f in v) != 1
           or not isinstance(v[-1], p.Finished | p.Failed)]  # fmt: skip
    assert len(frames) == num and not bad, (len(frames), bad[:5])
    ends = Counter(getattr(v[-1], "finish_reason", None) or v[-1].reason for v in frames.values())
    after = rate(hosts, ids)
    print(f"\nabort storm: {num} aborted, answers {dict(ends)}; pools idle {idle_in:.2f} s "
          f"after the last abort; {before:.1f} req/s before, {after:.1f} after")  # fmt: skip
    assert idle_in <= 5.0
    assert after >= before / 2
