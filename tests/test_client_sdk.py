"""The ZMQ client SDK against a tiny fake router (a ROUTER socket in a thread).

The fake "tokenizes" a text prompt as its bytes and echoes them back one token per
frame; it interleaves the replies of all pending requests (one frame from each in turn)
so that multiplexing by request_id is exercised. Prompt "fail" gets Failed(overloaded),
prompt "hang" gets no answer at all.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import zmq

from pdserve.common.errors import PdserveError, RequestError
from pdserve.common.runtime.protocol import (
    Abort,
    ClientToRouter,
    Decoder,
    Failed,
    Finished,
    Generate,
    Message,
    TokenChunk,
    Usage,
    encode,
)
from pdserve.services.router.client import (
    AsyncClient,
    Client,
    GenerationFailed,
    GenerationTimeout,
)


class FakeRouter:
    def __init__(self) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.address = f"tcp://127.0.0.1:{self.sock.bind_to_random_port('tcp://127.0.0.1')}"
        self.received: list[Message] = []
        self._outgoing: deque[deque[tuple[bytes, Message]]] = deque()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        decoder: Decoder[Generate | Abort] = Decoder(ClientToRouter)
        while not self._stop.is_set():
            while self.sock.poll(0 if self._outgoing else 20):
                identity, payload = self.sock.recv_multipart()
                msg = decoder.decode(payload)
                self.received.append(msg)
                if isinstance(msg, Generate):
                    replies = deque((identity, m) for m in self._replies(msg))
                    if replies:  # "hang" has none
                        self._outgoing.append(replies)
            for _ in range(len(self._outgoing)):  # one frame of each pending request in turn
                replies = self._outgoing.popleft()
                identity, msg = replies.popleft()
                self.sock.send_multipart([identity, encode(msg)])
                if replies:
                    self._outgoing.append(replies)
        self.sock.close()
        self.ctx.term()

    @staticmethod
    def _replies(gen: Generate) -> Iterator[Message]:
        rid = gen.request_id
        if gen.prompt == "hang":
            return
        if gen.prompt == "fail":
            yield Failed(request_id=rid, reason="overloaded", message="12 requests queued")
            return
        if gen.messages is not None:
            text = "|".join(f"{m.role}:{m.content}" for m in gen.messages)
            ids = list(text.encode())
        else:
            ids = gen.prompt_token_ids or list((gen.prompt or "").encode())
        out = ids[: gen.sampling.max_tokens]
        for token in out:
            yield TokenChunk(request_id=rid, trace_id="t", token_ids=[token], text=chr(token))
        reason = "length" if len(out) < len(ids) else "stop"
        usage = Usage(prompt_tokens=len(ids), completion_tokens=len(out))
        yield Finished(request_id=rid, trace_id="t", finish_reason=reason, usage=usage)

    def wait_for(self, predicate: Callable[[Message], bool], timeout: float = 5.0) -> Message:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for msg in list(self.received):
                if predicate(msg):
                    return msg
            time.sleep(0.01)
        raise AssertionError(f"the fake router never received it; got {self.received}")

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)


@pytest.fixture
def router() -> Iterator[FakeRouter]:
    fake = FakeRouter()
    yield fake
    fake.close()


@pytest.fixture
def client(router: FakeRouter) -> Iterator[Client]:
    with Client(router.address, timeout=10) as client:
        yield client


def is_abort_of(request_id: str) -> Callable[[Message], bool]:
    return lambda m: isinstance(m, Abort) and m.request_id == request_id


def test_generate(client: Client, router: FakeRouter) -> None:
    result = client.generate("Hello, world", max_tokens=5, temperature=0.5, stop="\n")
    assert result.text == "Hello"
    assert result.token_ids == list(b"Hello")
    assert result.finish_reason == "length"
    assert (result.usage.prompt_tokens, result.usage.completion_tokens) == (12, 5)
    gen = router.received[0]
    assert isinstance(gen, Generate) and gen.request_id == result.request_id
    assert result.request_id.startswith("sdk-") and not gen.stream
    sampling = gen.sampling
    assert (sampling.max_tokens, sampling.temperature, sampling.stop) == (5, 0.5, ("\n",))


def test_generate_ids_messages_and_own_id(client: Client) -> None:
    result = client.generate(prompt_token_ids=[72, 105], request_id="mine-1")
    assert (result.text, result.finish_reason, result.request_id) == ("Hi", "stop", "mine-1")
    result = client.generate(messages=[{"role": "user", "content": "yo"}], max_tokens=100)
    assert result.text == "user:yo"


def test_stream(client: Client, router: FakeRouter) -> None:
    chunks = list(client.stream("streaming", max_tokens=100))
    assert all(isinstance(c, TokenChunk) for c in chunks)
    assert "".join(c.text for c in chunks) == "streaming"
    gen = router.received[0]
    assert isinstance(gen, Generate) and gen.stream


def test_leaving_a_stream_aborts(client: Client, router: FakeRouter) -> None:
    stream = client.stream("a long answer", max_tokens=100)
    chunk = next(stream)
    del stream  # the stream left after its first chunk
    router.wait_for(is_abort_of(chunk.request_id))


def test_failed_raises(client: Client) -> None:
    with pytest.raises(GenerationFailed) as info:
        client.generate("fail")
    assert info.value.reason == "overloaded" and "12 requests queued" in info.value.message
    assert isinstance(info.value, PdserveError)
    with pytest.raises(GenerationFailed):
        list(client.stream("fail"))


def test_timeout_aborts(client: Client, router: FakeRouter) -> None:
    with pytest.raises(GenerationTimeout) as info:
        client.generate("hang", timeout=0.2)
    assert isinstance(info.value, TimeoutError) and info.value.reason == "timeout"
    router.wait_for(is_abort_of(info.value.request_id))


@pytest.mark.parametrize(
    "kwargs",
    [
        {},  # no prompt at all
        {"prompt": "a", "prompt_token_ids": [1]},
        {"prompt": "a", "max_tokens": 0},
        {"prompt": "a", "max_token": 5},  # a typo must not pass silently
        {"prompt": "a", "temperature": "hot"},
    ],
)
def test_bad_arguments(client: Client, router: FakeRouter, kwargs: dict[str, Any]) -> None:
    with pytest.raises(RequestError):
        client.generate(**kwargs)
    assert router.received == []  # refused before anything was sent


def test_threads_share_a_client(client: Client) -> None:
    prompts = [f"prompt number {i}" for i in range(8)]
    results: dict[str, str] = {}

    def run(prompt: str) -> None:
        results[prompt] = client.generate(prompt, max_tokens=100).text

    threads = [threading.Thread(target=run, args=(p,)) for p in prompts]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert results == {p: p for p in prompts}


def test_abort(client: Client, router: FakeRouter) -> None:
    client.abort("some-id")
    router.wait_for(is_abort_of("some-id"))


def test_async_client(router: FakeRouter) -> None:
    async def main() -> None:
        async with AsyncClient(router.address, timeout=10) as client:
            prompts = [f"concurrent {i}" for i in range(10)]
            results = await asyncio.gather(*(client.generate(p, max_tokens=100) for p in prompts))
            assert [r.text for r in results] == prompts
            assert len({r.request_id for r in results}) == 10

            text = "".join([c.text async for c in client.stream(prompt_token_ids=[97, 98, 99])])
            assert text == "abc"

            with pytest.raises(GenerationFailed, match="overloaded"):
                await client.generate("fail")

            stream = client.stream("leave early", max_tokens=100)
            first = await anext(stream)
            await stream.aclose()
            await asyncio.to_thread(router.wait_for, is_abort_of(first.request_id))

            with pytest.raises(GenerationTimeout):
                await client.generate("hang", timeout=0.2)

    asyncio.run(main())


def test_defaults_match_pdserve_up() -> None:
    from pdserve.common.runtime.service_config import DeploymentConfig
    from pdserve.services.router import client as sdk

    assert sdk.DEFAULT_ADDRESS == DeploymentConfig().front_address  # what `up` binds
    with Client() as client:
        assert client.address == sdk.DEFAULT_ADDRESS and client.timeout == sdk.DEFAULT_TIMEOUT_S


def test_no_router_fails_fast_instead_of_hanging() -> None:
    from pdserve.common.runtime.ports import free_port_block

    address = f"tcp://127.0.0.1:{free_port_block(1)}"
    started = time.monotonic()
    with Client(address, connect_timeout=0.5) as client:
        with pytest.raises(GenerationFailed) as info:
            client.generate("hello")
    assert info.value.reason == "unreachable" and address in info.value.message
    assert time.monotonic() - started < 5

    async def main() -> None:
        async with AsyncClient(address, connect_timeout=0.5) as client:
            with pytest.raises(GenerationFailed, match="no router answers"):
                await client.generate("hello")

    asyncio.run(main())


def test_router_going_away_fails_the_pending_request(router: FakeRouter) -> None:
    with Client(router.address, connect_timeout=0.5) as client:
        assert client.generate("up", max_tokens=2).text == "up"  # connected
        threading.Timer(0.3, router.close).start()
        with pytest.raises(GenerationFailed, match="went away") as info:
            client.generate("hang")
    assert info.value.reason == "unreachable"


def test_timeout_none_means_no_bound(client: Client) -> None:
    assert client.generate("abc", timeout=None).text == "abc"
