"""A fake router core and the real aiohttp app over it on a free port, for the HTTP API's
tests (test_http_*.py, test_tool_calls.py, test_fuzz_protocol.py).

The fake core echoes the prompt's tokens back (so expected text is known exactly) and
can be told to overload, fail, or go slowly (for disconnects). The fixtures give each
test module one server; ``core`` resets it per test.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import threading
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from pdserve.common.engine.sampling_params import TokenLogprobs
from pdserve.common.errors import RequestError
from pdserve.common.model.checkpoint.tokenizer import IncrementalDetokenizer, Tokenizer
from pdserve.common.runtime.protocol import Failed, Finished, Generate, TokenChunk, Usage
from pdserve.services.router import openapi
from pdserve.services.router.core_api import Event, Refused, RouterCore
from pdserve.services.router.http_api import make_app

openai = pytest.importorskip("openai")

MODEL = "fake-model"
OPENAPI_PATH = Path(openapi.__file__).with_name("openapi.json")


def fake_logprobs(token: int, i: int, num: int, seed: int | None = None) -> TokenLogprobs:
    """The chosen token at -i/10 (minus seed % 5 when seeded: candidates then differ in
    likelihood), alternatives token+1.. below -i/10."""
    tops = [token + 1 + k for k in range(num)]
    chosen = -i / 10 - (seed % 5 if seed is not None else 0)
    return TokenLogprobs(token_id=token, logprob=chosen, top_ids=tops,
                         top_logprobs=[-i / 10 - 1 - k for k in range(num)])  # fmt: skip


class FakeCore:
    """A RouterCore whose output is its input: prompt tokens back, max_tokens honoured."""

    model_name = MODEL
    max_model_len = 256
    trust_user_field = False

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.reset()

    def reset(self) -> None:
        self.mode = (
            "echo"  # echo | slow | overloaded | peer_down | draining | fail_mid | crash | reject
        )
        self.ready = True
        self.script: str | None = None  # when set: the answer's text instead of the prompt
        self.submitted: list[Generate] = []
        self.owners: list[str] = []  # each submit's client, as fair admission sees it
        self.closed: list[str] = []  # requests whose iterator was closed before the end

    def submit(self, gen: Generate, owner: str = "") -> AsyncIterator[Event]:
        # like the real core: RequestError and refusals before any event
        self.owners.append(owner)
        gen.sampling.validate()
        if not gen.prompt_token_ids or self.mode == "reject":
            raise RequestError("the fake core refuses this request")
        if self.mode in ("overloaded", "draining"):
            raise Refused(self.mode, f"fake {self.mode}")
        return self._run(gen)

    async def _run(self, gen: Generate) -> AsyncIterator[Event]:
        self.submitted.append(gen)
        rid, ids, limit = gen.request_id, gen.prompt_token_ids, gen.sampling.max_tokens
        if self.mode == "peer_down":  # as a real one found at dispatch
            yield Failed(request_id=rid, reason=self.mode, message=f"fake {self.mode}")
            return
        if self.mode == "crash":
            raise RuntimeError("fake core bug")
        out = (ids * (limit // len(ids) + 1))[:limit] if self.mode == "slow" else ids[:limit]
        if self.script is not None:
            out = self.tokenizer.encode(self.script, add_special_tokens=False)[:limit]
        detok = IncrementalDetokenizer(self.tokenizer)
        ended = False
        try:
            for i, token in enumerate(out):
                if self.mode == "slow":
                    await asyncio.sleep(0.02)
                if self.mode == "fail_mid" and i == 1:
                    ended = True
                    yield Failed(request_id=rid, reason="peer_down", message="decode-0 died")
                    return
                text = detok.add(token) + (detok.flush() if i == len(out) - 1 else "")
                logprobs = (
                    []
                    if gen.sampling.logprobs is None
                    else [fake_logprobs(token, i, gen.sampling.logprobs, gen.sampling.seed)]
                )
                top = gen.sampling.prompt_logprobs
                prompt_lps = (  # prompt token k at -k/10, on the first chunk
                    [fake_logprobs(t, k, top) for k, t in enumerate(ids[1:], 1)]
                    if top is not None and i == 0
                    else None
                )
                yield TokenChunk(request_id=rid, trace_id="t", token_ids=[token], text=text,
                                 logprobs=logprobs, prompt_logprobs=prompt_lps)  # fmt: skip
            ended = True
            usage = Usage(prompt_tokens=len(ids), completion_tokens=len(out))
            reason = "length" if len(out) == limit else "stop"
            yield Finished(request_id=rid, trace_id="t", finish_reason=reason, usage=usage)
        finally:
            if not ended:
                self.closed.append(rid)

    async def abort(self, request_id: str, owner: str = "") -> None:
        pass

    def is_ready(self) -> bool:
        return self.ready

    def health_detail(self) -> dict[str, Any]:
        return {"decode-0": "down"}

    async def metrics_text(self) -> bytes:
        return b"# TYPE pdserve:requests counter\npdserve:requests 3\n"


class Server:
    """make_app(core) on a free localhost port, in a thread with its own event loop."""

    def __init__(self, core: RouterCore, **options: Any) -> None:
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        self.runner = web.AppRunner(make_app(core, **options))
        self.port = asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(10)

    async def _start(self) -> int:
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", 0).start()
        return int(self.runner.addresses[0][1])

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(model_dir)


@pytest.fixture(scope="module")
def server_core(tokenizer: Tokenizer) -> Iterator[tuple[Server, FakeCore]]:
    core = FakeCore(tokenizer)
    server = Server(core)
    yield server, core
    server.stop()


@pytest.fixture
def core(server_core: tuple[Server, FakeCore]) -> FakeCore:
    server_core[1].reset()
    return server_core[1]


@pytest.fixture
def port(server_core: tuple[Server, FakeCore], core: FakeCore) -> int:
    return server_core[0].port


@pytest.fixture
def client(port: int) -> Any:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)


Reply = tuple[int, http.client.HTTPMessage, bytes]


def request(port: int, method: str, path: str, body: Any = None,
            headers: dict[str, str] | None = None) -> Reply:  # fmt: skip
    if body is not None and not isinstance(body, bytes):
        body = json.dumps(body).encode()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    conn.request(method, path, body=body, headers=headers or {})
    response = conn.getresponse()
    data = response.read()
    conn.close()
    return response.status, response.headers, data


def error_of(status: int, data: bytes, expected: int) -> dict[str, Any]:
    assert status == expected, data
    error = json.loads(data)["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


def sse_events(data: bytes) -> list[Any]:
    events = [e.removeprefix(b"data: ") for e in data.split(b"\n\n") if e]
    assert events[-1] == b"[DONE]"
    return [json.loads(e) for e in events[:-1]]


CHAT = [{"role": "user", "content": "x"}]
