"""Issue 40, the router's side, on a real deployment of the tiny model: no request hangs,
no client stalls another. Long chunked uploads are tokenised off the loop (/health stays
quick, streams beside them finish), a burst of long prompts each gets an answer or a
clear error, one client's backlog does not hold another's short request, a stalled
upload is dropped, a stream gets its headers before its first token."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from pdserve.cli.deployment import Deployment
from pdserve.common.runtime.fault_hooks import HOLD_PULLS_ENV
from tests.e2e import deployment
from tests.fault_tools import wait_until
from tests.hostile_tools import PROMPT, router_metrics

pytestmark = pytest.mark.slow

BODY_TIMEOUT = 1.0
TOKENIZE_TIMEOUT = 20.0
FIRST_TOKEN_TIMEOUT = 30.0
SETTINGS = {
    "body_read_timeout_seconds": BODY_TIMEOUT,
    "tokenize_timeout_seconds": TOKENIZE_TIMEOUT,
    "first_token_timeout_seconds": FIRST_TOKEN_TIMEOUT,
    "ping_seconds": 0.5,
    "peer_timeout_seconds": 3.0,
    "drain_seconds": 2.0,
}
SEATS = 4  # decode's max_num_seqs: the router dispatches 4 + 1 at once (dispatch_window)
# A 20 KB text of 80-character tokens: tokenised in the pool like any long prompt, but
# ~250 tokens, so 250 of them prefill in seconds on a CPU.
LONG_TOKENS = "#" * 20_000
NUM_UPLOADS = 30  # the count

# The busy client, in a process of its own at a low CPU priority: a client is another
# machine, not a share of the two cores the services run on here.
BUSY_CLIENT = """
import asyncio, json, os, sys, threading
os.nice(10)
from pdserve.services.router.client import AsyncClient
PROMPT = json.loads(sys.argv[2])

async def main():
    stop, done = asyncio.Event(), [0]
    loop = asyncio.get_running_loop()
    threading.Thread(target=lambda: (sys.stdin.read(), loop.call_soon_threadsafe(stop.set)),
                     daemon=True).start()
    async with AsyncClient(sys.argv[1], timeout=120) as client:
        async def keep_busy(k):
            while not stop.is_set():
                await client.generate(prompt_token_ids=PROMPT + [k], max_tokens=8, ignore_eos=True)
                done[0] += 1
        await asyncio.gather(*(keep_busy(k) for k in range(256)))
    print(done[0], flush=True)

asyncio.run(main())
"""

HEALTH_POLLER = """
import http.client, sys, time
host, port, seconds = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
conn = http.client.HTTPConnection(host, port, timeout=10)
worst, end = 0.0, time.monotonic() + seconds
while time.monotonic() < end:
    start = time.monotonic()
    conn.request("GET", "/health")
    conn.getresponse().read()
    worst = max(worst, time.monotonic() - start)
    time.sleep(0.01)
print(worst, flush=True)
"""


@pytest.fixture(scope="module")
def hold(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("hold") / "hold-pulls"


@pytest.fixture(scope="module")
def dep(
    tmp_path_factory: pytest.TempPathFactory, model_dir: Path, hold: Path
) -> Iterator[Deployment]:
    tmp = tmp_path_factory.mktemp("load")
    with deployment(tmp, model_dir, engine={"max_num_seqs": SEATS}, env={HOLD_PULLS_ENV: str(hold)},
                    **SETTINGS) as d:  # fmt: skip
        yield d


def host_port(dep: Deployment) -> tuple[str, int]:
    return dep.cfg.http_bind_host, dep.cfg.http_port


def health_poller(dep: Deployment, seconds: float) -> subprocess.Popen[str]:
    """/health's worst latency over ``seconds``, from a process of its own (the test's own
    threads do not delay it)."""
    host, port = host_port(dep)
    return subprocess.Popen([sys.executable, "-c", HEALTH_POLLER, host, str(port), str(seconds)],
                            stdout=subprocess.PIPE, text=True)  # fmt: skip


async def post(session: Any, dep: Deployment, body: dict[str, Any] | AsyncIterator[bytes],
               path: str = "/v1/completions") -> tuple[int, dict[str, Any], float]:  # fmt: skip
    """(status, JSON body, seconds); a dict body is sent with a Content-Length, an async
    iterator of bytes chunked."""
    started = time.monotonic()
    data = json.dumps(body).encode() if isinstance(body, dict) else body
    async with session.post(f"{dep.url}{path}", data=data,
                            headers={"Content-Type": "application/json"}) as resp:  # fmt: skip
        return resp.status, await resp.json(), time.monotonic() - started


async def chunked(text: str, chunk: int = 65_536) -> AsyncIterator[bytes]:
    body = json.dumps({"prompt": text, "max_tokens": 4}).encode()
    for start in range(0, len(body), chunk):
        yield body[start : start + chunk]


def test_chunked_long_prompts_beside_streams(dep: Deployment) -> None:
    """Issue item 1: 30 concurrent chunked 0.62 MB prompts stalled the loop 9.9 s, and
    decode aborted 8 other users' streams (peer_down). Here the same 30 beside 8 streams:
    each is tokenised in the pool (0.4 s of one core) and refused (230k tokens), or, once
    the one worker is behind by more than the tokenize deadline (on a busy 2-core machine
    the last of the 30 can be), failed with a 504 that says so; /health is polled for the
    whole run."""
    import aiohttp

    from pdserve.services.router.client import AsyncClient

    before = router_metrics(dep)
    text = "lorem ipsum dolor sit amet " * 23_000  # 0.62 MB

    async def main() -> tuple[list[Any], list[int]]:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session, \
                AsyncClient(dep.cfg.front_address, timeout=120) as sdk:  # fmt: skip
            streams = [
                asyncio.create_task(
                    sdk.generate(prompt_token_ids=PROMPT + [k], max_tokens=48, ignore_eos=True)
                )  # fmt: skip
                for k in range(8)
            ]
            uploads = await asyncio.gather(*(post(session, dep, chunked(text))
                                             for _ in range(NUM_UPLOADS)))  # fmt: skip
            return uploads, [len(r.token_ids) for r in await asyncio.gather(*streams)]

    poller = health_poller(dep, NUM_UPLOADS * 0.4)
    started = time.monotonic()
    uploads, lengths = asyncio.run(main())
    took = time.monotonic() - started
    assert poller.stdout is not None
    worst_health = float(poller.stdout.read())
    poller.wait(10)
    print(f"{NUM_UPLOADS} chunked 0.62 MB uploads + 8 streams: {took:.1f} s, /health worst "
          f"{worst_health * 1000:.0f} ms")  # fmt: skip
    assert lengths == [48] * 8
    for status, body, _ in uploads:
        assert (status, body["error"]["code"]) in (
            (400, "context_length_exceeded"),
            (504, "timeout"),
        ), body
    after = router_metrics(dep)
    assert after["pdserve:peer_down_total"] == before["pdserve:peer_down_total"]
    # The router's loop never stalled past its 0.5 s ping (the tokenising is off the loop);
    # /health's worst time is printed above, not asserted (a shared machine's noise).
    assert after["pdserve:loop_stalls_total"] == before["pdserve:loop_stalls_total"]


def test_a_burst_of_long_prompts_each_gets_an_answer(dep: Deployment) -> None:
    """Issue item 2: of 20 concurrent 20 KB chat requests 7 got no answer in 60 s (the
    pool's deadlock) and later long requests hung. Here 200 at once, then 50 one by one:
    each an answer or a clear error, within its deadlines."""
    import aiohttp

    bound = TOKENIZE_TIMEOUT + FIRST_TOKEN_TIMEOUT + 10.0

    def body(k: int) -> dict[str, Any]:
        return {"messages": [{"role": "user", "content": f"{k} {LONG_TOKENS}"}], "max_tokens": 2}

    async def main() -> tuple[list[Any], list[Any]]:
        timeout = aiohttp.ClientTimeout(total=bound)
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
            burst = await asyncio.gather(*(post(session, dep, body(k), "/v1/chat/completions")
                                           for k in range(200)))  # fmt: skip
            one_by_one = [await post(session, dep, body(k), "/v1/chat/completions")
                          for k in range(200, 250)]  # fmt: skip
            return burst, one_by_one

    started = time.monotonic()
    burst, one_by_one = asyncio.run(main())  # a hang fails here, at the client's timeout
    took = time.monotonic() - started
    for status, answer, _ in burst + one_by_one:
        if status != 200:  # a clear error: OpenAI's body with a reason
            assert status in (429, 503, 504) and answer["error"]["code"], answer
        else:
            assert answer["choices"][0]["finish_reason"] in ("length", "stop"), answer
    assert all(status == 200 for status, _, _ in one_by_one)  # the pool is not wedged
    served = sum(status == 200 for status, _, _ in burst)
    worst = max(seconds for _, _, seconds in burst + one_by_one)
    print(f"200 + 50 20 KB prompts: {served}/200 of the burst served, {200 - served} refused; "
          f"{took:.1f} s, slowest {worst:.1f} s")  # fmt: skip


def test_one_clients_backlog_does_not_hold_another(dep: Deployment) -> None:
    """Issue item 4: one client within its 256-request share made others wait 10.9-13.7 s
    for a 4-token answer (1.3 s idle): the short request waited behind the whole backlog.
    Here its 256 wait their turn at the router and the other client's request goes first,
    measured in requests, not seconds: while each short request is in flight, the router
    finishes a few of the busy client's, not the hundreds queued before it. The busy client
    is a process of its own, as it would be; times are printed (median of 9), not asserted."""
    from pdserve.services.router.client import Client

    def finished() -> float:
        return router_metrics(dep)["pdserve:requests_total"]

    def measure(client: Client) -> tuple[float, float, float]:
        """Median seconds, median requests finished meanwhile (its own excluded), median
        requests running at the router after each."""
        times, passed, running = [], [], []
        for _ in range(9):
            before = finished()
            started = time.monotonic()
            out = client.generate(prompt_token_ids=PROMPT, max_tokens=4, ignore_eos=True)
            times.append(time.monotonic() - started)
            metrics = router_metrics(dep)
            passed.append(metrics["pdserve:requests_total"] - before - 1)
            running.append(metrics["pdserve:num_requests_running"])
            assert len(out.token_ids) == 4
        return statistics.median(times), statistics.median(passed), statistics.median(running)

    with Client(dep.cfg.front_address, timeout=120) as other:
        for _ in range(3):  # warm
            other.generate(prompt_token_ids=PROMPT, max_tokens=4)
        idle, _, _ = measure(other)
        busy = subprocess.Popen([sys.executable, "-c", BUSY_CLIENT, dep.cfg.front_address,
                                 json.dumps(PROMPT)],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)  # fmt: skip
        try:
            wait_until(lambda: router_metrics(dep)["pdserve:num_requests_running"] >= 250, 30,
                       "the busy client's 256 requests in flight")  # fmt: skip
            loaded, overtaken, held = measure(other)
        finally:
            assert busy.stdin is not None and busy.stdout is not None
            busy.stdin.close()  # it stops
            done = int(busy.stdout.read() or 0)
            busy.wait(60)
    print(f"4-token request: idle {idle:.3f} s, beside a client with {held:.0f} in flight "
          f"{loaded:.3f} s ({loaded / idle:.1f}x); {overtaken:.0f} of that client's finished "
          f"meanwhile (median); it finished {done}")  # fmt: skip
    # The backlog was there (the busy client resubmits at a low priority, so the count dips
    # by a few between its answers) and it was served.
    assert held >= 200 and done > 0, (held, done)
    # Behind the backlog, a short request would see ~all 256 finish first.
    assert overtaken < 64, overtaken


def test_a_stalled_upload_is_dropped_and_a_stream_has_headers_at_once(
    dep: Deployment, hold: Path
) -> None:
    """Issue item 5: uploads that never finish were held forever (400 fds), and streams
    sent no headers until their first token."""
    host, port = host_port(dep)

    def stalled(head: bytes, trickle: bytes = b"") -> tuple[bytes, float]:
        """What the router answers, and when it closes, to an upload that never ends."""
        with socket.create_connection((host, port), timeout=BODY_TIMEOUT + 10) as sock:
            started = time.monotonic()
            sock.sendall(head)
            got = b""
            sock.settimeout(0.2)
            while time.monotonic() - started < BODY_TIMEOUT + 10:
                try:
                    data = sock.recv(65_536)
                except TimeoutError:
                    if trickle:
                        sock.sendall(trickle)  # an endless chunked body: a chunk now and then
                    continue
                except ConnectionResetError:
                    break
                if not data:
                    break
                got += data
            return got, time.monotonic() - started

    big = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
           b"Content-Length: 1000000\r\n\r\n{\"prompt\": \"hello\",")  # fmt: skip
    endless = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
               b"Transfer-Encoding: chunked\r\n\r\n5\r\n{\"pro\r\n")  # fmt: skip
    for head, trickle in ((big, b""), (endless, b"1\r\n \r\n")):
        answer, seconds = stalled(head, trickle)
        assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
        assert b"body_read_timeout_seconds" in answer
        assert seconds < BODY_TIMEOUT + 2.0, seconds  # dropped, not kept
    huge = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 1000000000\r\n\r\n{}")  # fmt: skip
    answer, seconds = stalled(huge)
    assert answer.startswith(b"HTTP/1.1 413") and seconds < BODY_TIMEOUT + 2.0, answer[:200]

    # A stream whose first token cannot come yet (decode's pulls held): its headers do.
    hold.touch()
    try:
        with socket.create_connection((host, port), timeout=30) as sock:
            body = json.dumps({"prompt": "Hello", "max_tokens": 4, "stream": True}).encode()
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                         b"Content-Type: application/json\r\nContent-Length: "
                         + str(len(body)).encode() + b"\r\n\r\n" + body)  # fmt: skip
            sock.settimeout(10)
            head = sock.recv(65_536)
            assert head.startswith(b"HTTP/1.1 200") and b"text/event-stream" in head, head
            assert b'"text":"' not in head.split(b"\r\n\r\n", 1)[1]  # no token yet
            hold.unlink()
            rest = b""
            while b"[DONE]" not in rest:
                data = sock.recv(65_536)
                assert data, rest
                rest += data
            assert b'"finish_reason":"length"' in rest, rest
    finally:
        hold.unlink(missing_ok=True)
    wait_until(lambda: router_metrics(dep)["pdserve:num_requests_running"] == 0, 30,
               "the router to hold no request")  # fmt: skip


LOST_CLIENT = """
import os, sys
from pdserve.services.router.client import Client
client = Client(sys.argv[1], timeout=60)
for chunk in client.stream(prompt_token_ids=[1, 504, 3458], max_tokens=400, ignore_eos=True):
    os._exit(0)  # gone mid-stream: no abort sent, the connection just drops
"""


def test_a_lost_sdk_client_is_logged_once_not_per_token(dep: Deployment) -> None:
    """Issue item 5: a lost SDK connection logged one warning per token."""
    log = dep.log_path("router")
    before = log.read_text().count("client_send_failed")
    subprocess.run([sys.executable, "-c", LOST_CLIENT, dep.cfg.front_address], check=True,
                   timeout=60)  # fmt: skip
    wait_until(lambda: router_metrics(dep)["pdserve:num_requests_running"] == 0, 30,
               "the router to abort the lost client's request")  # fmt: skip
    assert log.read_text().count("client_send_failed") - before <= 1


def test_requests_right_after_a_router_stall_are_served(dep: Deployment) -> None:
    """Issue item 5: after a router stall over 5 s (ZeroMQ's heartbeat drops the links to
    the services), new requests got 503 for a while. They wait for the instances to answer
    a ping again instead."""
    import urllib.error
    import urllib.request

    def status() -> int:
        body = json.dumps({"prompt": "hi", "max_tokens": 2}).encode()
        req = urllib.request.Request(f"{dep.url}/v1/completions", body,
                                     {"Content-Type": "application/json"})  # fmt: skip
        try:
            with urllib.request.urlopen(req, timeout=30) as resp:
                return int(resp.status)
        except urllib.error.HTTPError as err:
            return err.code

    router = dep.procs["router"].pid
    os.kill(router, signal.SIGSTOP)
    try:
        time.sleep(6.0)
    finally:
        os.kill(router, signal.SIGCONT)
    assert [status() for _ in range(20)] == [200] * 20
