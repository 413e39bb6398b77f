"""The OpenAI-compatible HTTP API, behind a real aiohttp server, against a fake core.

The fake core echoes the prompt's tokens back (so expected text is known exactly) and
can be told to overload, fail, or go slowly (for disconnects). Well-formed requests go
through the official `openai` SDK, because SDK compatibility is the point; error cases
go through raw HTTP so that status codes and bodies are seen as they are.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from pdserve.common.engine.sampling_params import SamplingParams, TokenLogprobs
from pdserve.common.errors import RequestError
from pdserve.common.model.tokenizer import IncrementalDetokenizer, Tokenizer
from pdserve.common.runtime.protocol import Failed, Finished, Generate, TokenChunk, Usage
from pdserve.services.router import openapi
from pdserve.services.router.core_api import Event, RouterCore
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
        self.closed: list[str] = []  # requests whose iterator was closed before the end

    def submit(self, gen: Generate, owner: str = "") -> AsyncIterator[Event]:
        return self._run(gen)

    async def _run(self, gen: Generate) -> AsyncIterator[Event]:
        gen.sampling.validate()  # like the real core: RequestError before any event
        if not gen.prompt_token_ids or self.mode == "reject":
            raise RequestError("the fake core refuses this request")
        self.submitted.append(gen)
        rid, ids, limit = gen.request_id, gen.prompt_token_ids, gen.sampling.max_tokens
        if self.mode in ("overloaded", "peer_down", "draining"):
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


# -- happy paths, through the official SDK ---------------------------------------------------


def test_models(client: Any) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL


def test_completion(client: Any, core: FakeCore, tokenizer: Tokenizer) -> None:
    prompt = "The capital of France is a city called"
    ids = tokenizer.encode(prompt)
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3)
    assert out.choices[0].text == tokenizer.decode(ids[:3])
    assert out.choices[0].finish_reason == "length"
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (len(ids), 3)
    assert out.usage.total_tokens == len(ids) + 3
    assert out.id.startswith("cmpl-") and core.submitted[0].request_id == out.id
    assert core.submitted[0].prompt_token_ids == ids


def test_completion_defaults_and_sampling(client: Any, core: FakeCore) -> None:
    client.completions.create(model=MODEL, prompt="a b c d e f g h i j k l m n o p q r s t")
    assert core.submitted[-1].sampling.max_tokens == 16  # OpenAI's default
    client.completions.create(
        model=MODEL, prompt="hi there", max_tokens=5, temperature=0.5, top_p=0.9, seed=7,
        stop=["x", "y"], extra_body={"top_k": 20, "ignore_eos": True},
    )  # fmt: skip
    sp = core.submitted[-1].sampling
    assert (sp.max_tokens, sp.temperature, sp.top_p, sp.top_k, sp.seed) == (5, 0.5, 0.9, 20, 7)
    assert sp.stop == ("x", "y") and sp.ignore_eos
    client.completions.create(model=MODEL, prompt="hi", stop="\n")
    assert core.submitted[-1].sampling.stop == ("\n",)
    client.completions.create(model=MODEL, prompt=[1.0, 2.0], max_tokens=4.0)  # JSON numbers
    assert core.submitted[-1].sampling.max_tokens == 4
    assert core.submitted[-1].prompt_token_ids == [1, 2]


def test_completion_prompt_shapes(client: Any, core: FakeCore, tokenizer: Tokenizer) -> None:
    texts = ["one two three", "four five"]
    out = client.completions.create(model=MODEL, prompt=texts, max_tokens=50)
    assert [c.index for c in out.choices] == [0, 1]
    assert [c.text for c in out.choices] == [tokenizer.decode(tokenizer.encode(t)) for t in texts]
    assert [c.finish_reason for c in out.choices] == ["stop", "stop"]
    assert len({g.request_id for g in core.submitted}) == 2
    out = client.completions.create(model=MODEL, prompt=[100, 200, 300], max_tokens=2)
    assert core.submitted[-1].prompt_token_ids == [100, 200, 300]
    out = client.completions.create(model=MODEL, prompt=[[100, 200], [300]], max_tokens=2)
    assert len(out.choices) == 2 and out.usage.prompt_tokens == 3


def test_completion_stream(client: Any, tokenizer: Tokenizer) -> None:
    prompt = "Streaming is fun, isn't it?"
    chunks = list(client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=100, stream=True,
        stream_options={"include_usage": True},
    ))  # fmt: skip
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == tokenizer.decode(tokenizer.encode(prompt))
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens > 0


def test_chat(client: Any, core: FakeCore, tokenizer: Tokenizer) -> None:
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    ids = tokenizer.encode_chat(messages)
    out = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=200)
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == tokenizer.decode(ids)
    assert out.choices[0].finish_reason == "stop"
    assert out.usage.prompt_tokens == len(ids) and out.id.startswith("chatcmpl-")
    assert core.submitted[-1].prompt_token_ids == ids
    parts = [{"role": "user", "content": [{"type": "text", "text": "What is the capital"},
                                          {"type": "text", "text": "of France?"}]}]  # fmt: skip
    client.chat.completions.create(model=MODEL, messages=parts, max_completion_tokens=4)
    joined = [{"role": "user", "content": "What is the capital\nof France?"}]
    assert core.submitted[-1].prompt_token_ids == tokenizer.encode_chat(joined)
    assert core.submitted[-1].sampling.max_tokens == 4
    client.chat.completions.create(model=MODEL, messages=messages)  # no limit: the context's room
    assert core.submitted[-1].sampling.max_tokens == core.max_model_len - len(ids)


@pytest.mark.parametrize("include_usage", [True, False])
def test_chat_stream(client: Any, tokenizer: Tokenizer, include_usage: bool) -> None:
    messages = [{"role": "user", "content": "Hi!"}]
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=5, stream=True,
        stream_options={"include_usage": include_usage},
    ))  # fmt: skip
    assert chunks[0].choices[0].delta.role == "assistant"
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == tokenizer.decode(tokenizer.encode_chat(messages)[:5])
    with_choices = [c for c in chunks if c.choices]
    assert with_choices[-1].choices[0].finish_reason == "length"
    assert all(c.choices[0].finish_reason is None for c in with_choices[:-1])
    if include_usage:
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 5
    else:
        assert all(c.usage is None for c in chunks)


def test_request_id_echo(client: Any, core: FakeCore) -> None:
    raw = client.completions.with_raw_response.create(
        model=MODEL, prompt="hello", max_tokens=2, extra_headers={"x-request-id": "trace-42"}
    )
    assert raw.headers["x-request-id"] == "trace-42"
    assert raw.parse().id == "cmpl-trace-42" == core.submitted[-1].request_id
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=1
    )
    assert raw.headers["x-request-id"] == raw.parse().id  # none sent: the generated id


def test_request_id_echo_on_stream_and_error(port: int) -> None:
    body = {"prompt": "hello", "max_tokens": 2, "stream": True}
    status, headers, _ = request(port, "POST", "/v1/completions", body, {"x-request-id": "s-1"})
    assert status == 200 and headers["x-request-id"] == "s-1"
    assert headers["Content-Type"].startswith("text/event-stream")
    status, headers, _ = request(port, "POST", "/v1/completions", b"{", {"x-request-id": "e-1"})
    assert status == 400 and headers["x-request-id"] == "e-1"


def test_sdk_sees_errors(client: Any) -> None:
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.completions.create(model="gpt-4", prompt="hi")


# -- errors, over raw HTTP ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "param", "code"),
    [
        ({"prompt": "hi", "max_tokens": -1}, "max_tokens", "invalid_value"),
        ({"prompt": "hi", "max_tokens": "3"}, "max_tokens", "invalid_value"),
        ({"prompt": "hi", "max_tokens": 2.5}, "max_tokens", "invalid_value"),
        ({"prompt": "hi", "n": 0}, "n", "invalid_value"),
        # OpenAI's limit; an unbounded n once made one body allocate 8 GB (schemathesis)
        ({"prompt": "hi", "n": 129}, "n", "invalid_value"),
        ({"prompt": "hi", "best_of": 2**70}, "best_of", "invalid_value"),
        ({"prompt": "hi", "n": 3, "best_of": 2}, "best_of", "unsupported_parameter"),
        (
            {"prompt": "hi", "n": 1, "best_of": 2, "stream": True},
            "best_of",
            "unsupported_parameter",
        ),
        ({"prompt": "hi", "logprobs": 21}, "logprobs", "invalid_value"),
        ({"prompt": "hi", "temperature": -0.5}, "temperature", "invalid_value"),
        ({"prompt": "hi", "top_p": 0}, "top_p", "invalid_value"),
        ({"max_tokens": 3}, None, "invalid_value"),  # no prompt
        ({"prompt": ""}, "prompt", "invalid_value"),
        ({"prompt": [1, "a"]}, "prompt", "invalid_value"),
        ({"prompt": [10**6]}, "prompt", "invalid_value"),  # outside the vocabulary
        ({"prompt": "hi", "max_tokens": 10_000}, "max_tokens", "context_length_exceeded"),
        ({"prompt": [5] * 300}, "prompt", "context_length_exceeded"),
        ({"prompt": "hi", "stop": [""]}, "stop[0]", "invalid_value"),
        ({"prompt": "hi", "frequency_penalty": 2.5}, "frequency_penalty", "invalid_value"),
        ({"prompt": "hi", "logit_bias": {"x": 1}}, "logit_bias", "unsupported_parameter"),
        ({"prompt": "hi", "logit_bias": {"1": 101}}, "logit_bias[...]", "invalid_value"),
        ({"prompt": "hi", "logit_bias": {"999999": 1}}, None, "bad_request"),  # vocabulary
        ({"prompt": "hi", "min_tokens": 20, "max_tokens": 5}, None, "bad_request"),
        ({"prompt": "hi", "repetition_penalty": 0}, "repetition_penalty", "invalid_value"),
        ({"prompt": "hi", "min_p": 2}, "min_p", "invalid_value"),
    ],
)
def test_completion_errors(port: int, body: Any, param: str | None, code: str | None) -> None:
    error = error_of(*request(port, "POST", "/v1/completions", body)[::2], 400)
    assert (error["param"], error["code"]) == (param, code)
    assert error["type"] == "invalid_request_error" and error["message"]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
         "messages[0].content"),
        ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
        ({"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 21},
         "top_logprobs"),
        ({"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0},
         "max_completion_tokens"),
        ({"messages": [{"role": "user", "content": "x"}],
          "response_format": {"type": "json_schema"}}, "response_format"),
    ],
)  # fmt: skip
def test_chat_errors(port: int, body: Any, param: str) -> None:
    error = error_of(*request(port, "POST", "/v1/chat/completions", body)[::2], 400)
    assert error["param"] == param


def test_malformed_json(port: int) -> None:
    for body in (b"{not json", b"", b"[1, 2]"):
        error = error_of(*request(port, "POST", "/v1/completions", body)[::2], 400)
        assert error["type"] == "invalid_request_error"


def test_routes_and_methods(port: int) -> None:
    error = error_of(*request(port, "GET", "/v1/nope")[::2], 404)
    assert "/v1/nope" in error["message"]
    status, headers, data = request(port, "GET", "/v1/completions")
    assert "POST" in error_of(status, data, 405)["message"] and headers["Allow"] == "POST"
    error_of(*request(port, "GET", "/v1/models/other")[::2], 404)


def test_core_request_error_is_400(port: int, core: FakeCore) -> None:
    core.mode = "reject"
    error = error_of(*request(port, "POST", "/v1/completions", {"prompt": "hi"})[::2], 400)
    assert error["code"] == "bad_request" and "refuses" in error["message"]


def test_overloaded_is_429(port: int, core: FakeCore) -> None:
    core.mode = "overloaded"
    for stream in (False, True):
        status, headers, data = request(port, "POST", "/v1/completions",
                                        {"prompt": "hi", "stream": stream})  # fmt: skip
        assert error_of(status, data, 429)["code"] == "overloaded"
        assert headers["Retry-After"]


def test_peer_down_is_503(port: int, core: FakeCore) -> None:
    core.mode = "peer_down"
    status, _, data = request(port, "POST", "/v1/chat/completions",
                              {"messages": [{"role": "user", "content": "x"}]})  # fmt: skip
    assert error_of(status, data, 503)["code"] == "peer_down"


def test_draining_is_503_with_retry_after(port: int, core: FakeCore) -> None:
    core.mode = "draining"  # the router (or the instance) is shutting down
    status, headers, data = request(port, "POST", "/v1/completions", {"prompt": "hi"})
    assert error_of(status, data, 503)["code"] == "draining"
    assert headers["Retry-After"]


def test_failure_mid_stream(port: int, core: FakeCore) -> None:
    core.mode = "fail_mid"
    body = {"prompt": "one two three", "stream": True}
    status, _, data = request(port, "POST", "/v1/completions", body)
    assert status == 200
    events = sse_events(data)
    assert events[0]["choices"][0]["text"]  # the token before the failure
    error = events[-1]["error"]
    assert error["code"] == "peer_down" and "decode-0" in error["message"]
    body["stream"] = False  # no token can be taken back: the whole answer fails
    assert error_of(*request(port, "POST", "/v1/completions", body)[::2], 503)


def test_internal_error_is_500_without_traceback(port: int, core: FakeCore) -> None:
    core.mode = "crash"
    status, headers, data = request(port, "POST", "/v1/completions", {"prompt": "hi"},
                                    {"x-request-id": "boom"})  # fmt: skip
    error = error_of(status, data, 500)
    assert error["code"] == "internal" and "boom" in error["message"]
    assert headers["x-request-id"] == "boom"
    assert b"Traceback" not in data and b"fake core bug" not in data


@pytest.mark.parametrize("stream", [True, False])
def test_client_disconnect_aborts(port: int, core: FakeCore, stream: bool) -> None:
    core.mode = "slow"  # 200 tokens at 20 ms each: far longer than the test
    body = json.dumps({"prompt": "hello", "max_tokens": 200, "stream": stream}).encode()
    sock = socket.create_connection(("127.0.0.1", port), timeout=5)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(body), body))  # fmt: skip
    if stream:
        received = b""
        while b"data: " not in received:  # the stream is running
            received += sock.recv(65536)
    else:
        deadline = time.monotonic() + 5
        while not core.submitted and time.monotonic() < deadline:
            time.sleep(0.01)
    sock.close()
    deadline = time.monotonic() + 5
    while not core.closed and time.monotonic() < deadline:
        time.sleep(0.01)
    assert core.closed == [core.submitted[0].request_id]


# -- health, metrics, schema -------------------------------------------------------------------


def test_health(port: int, core: FakeCore) -> None:
    status, _, data = request(port, "GET", "/health")
    assert (status, json.loads(data)) == (200, {"status": "ok"})
    core.ready = False
    status, _, data = request(port, "GET", "/health")
    assert status == 503 and json.loads(data)["detail"] == {"decode-0": "down"}


def test_metrics(port: int) -> None:
    status, headers, data = request(port, "GET", "/metrics")
    assert status == 200 and headers["Content-Type"].startswith("text/plain; version=0.0.4")
    assert b"pdserve:requests 3" in data


def test_openapi_is_served_and_current(port: int, core: FakeCore) -> None:
    status, _, data = request(port, "GET", "/openapi.json")
    assert status == 200
    served = json.loads(data)
    assert set(served["paths"]) >= {"/v1/models", "/v1/completions", "/v1/chat/completions",
                                     "/health", "/metrics"}  # fmt: skip
    assert served == json.loads(
        json.dumps(openapi.openapi(MODEL, FakeCore.max_model_len, core.tokenizer.vocab_size))
    )
    request_fields = served["components"]["schemas"]["CompletionRequest"]["properties"]
    assert request_fields["model"]["anyOf"][0] == {"enum": [MODEL]}
    # Regenerate: python -m pdserve.services.router.openapi > services/router/openapi.json
    generic = json.loads(json.dumps(openapi.openapi()))
    assert json.loads(OPENAPI_PATH.read_bytes()) == generic, "openapi.json is stale"


# -- every field honoured or refused; null is the default -----------------------------------


def test_null_means_default(client: Any, core: FakeCore) -> None:
    client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
        temperature=None, top_p=None, n=None, stream=None, presence_penalty=None,
        frequency_penalty=None, seed=None, stop=None, logit_bias=None, logprobs=None,
        top_logprobs=None, tools=None, tool_choice=None, response_format=None,
        extra_body={"top_k": None, "min_p": None, "repetition_penalty": None,
                    "min_tokens": None, "ignore_eos": None, "echo": None},
    )  # fmt: skip
    assert core.submitted[-1].sampling == SamplingParams(max_tokens=2, temperature=1.0)


def test_sampling_fields_reach_the_engine(client: Any, core: FakeCore) -> None:
    client.completions.create(
        model=MODEL, prompt="hi", max_tokens=8, presence_penalty=0.5, frequency_penalty=-0.5,
        logit_bias={"17": -100, "3": 2.5},
        extra_body={"repetition_penalty": 1.3, "min_tokens": 4, "min_p": 0.1,
                    "include_stop_str_in_output": True},
    )  # fmt: skip
    sp = core.submitted[-1].sampling
    assert (sp.presence_penalty, sp.frequency_penalty, sp.repetition_penalty) == (0.5, -0.5, 1.3)
    assert (sp.min_tokens, sp.min_p, sp.include_stop_str_in_output) == (4, 0.1, True)
    assert sp.logit_bias == {17: -100.0, 3: 2.5}


CHAT = [{"role": "user", "content": "x"}]


@pytest.mark.parametrize(
    ("path", "extra", "param"),
    [
        ("/v1/completions", {"guided_json": "{no", "guided_regex": "a"}, "guided_json"),
        ("/v1/completions", {"guided_choice": []}, "guided_choice"),
        ("/v1/completions", {"guided_regex": "a+", "guided_choice": ["a"]}, "guided_choice"),
        ("/v1/completions", {"structured_outputs": {"json": {}, "regex": "a"}},
         "structured_outputs"),
        ("/v1/completions", {"guided_decoding_backend": "outlines"}, "guided_decoding_backend"),
        ("/v1/chat/completions", {"prompt_logprobs": 1}, "prompt_logprobs"),
        ("/v1/completions", {"suffix": "end"}, "suffix"),
        ("/v1/completions", {"use_beam_search": True}, "use_beam_search"),
        ("/v1/completions", {"skip_special_tokens": False}, "skip_special_tokens"),
        ("/v1/chat/completions", {"guided_json": {"type": "object"},
                                  "response_format": {"type": "json_object"}}, "guided_json"),
        ("/v1/chat/completions", {"functions": [{"name": "f"}]}, "functions"),
        ("/v1/chat/completions", {"function_call": "auto"}, "function_call"),
        ("/v1/chat/completions", {"tools": [{"type": "function"}]}, "tools[0]"),
        ("/v1/chat/completions", {"tool_choice": "required"}, "tool_choice"),
        ("/v1/chat/completions", {"tools": [{"type": "function", "function": {"name": "f"}}],
                                  "tool_choice": {"type": "function", "function": {"name": "g"}}},
         "tool_choice"),
        ("/v1/chat/completions", {"tools": [{"type": "function", "function": {"name": "f"}}],
                                  "tool_choice": "required",
                                  "response_format": {"type": "json_object"}}, "tool_choice"),
        ("/v1/chat/completions", {"chat_template": "{{ messages }}"}, "chat_template"),
        ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {
            "name": "x"}}}, "response_format"),
        ("/v1/chat/completions", {"response_format": {"type": "yaml"}}, "response_format"),
        ("/v1/chat/completions", {"continue_final_message": True, "add_generation_prompt": True},
         "continue_final_message"),
        ("/v1/chat/completions", {"messages": [
            {"role": "function", "name": "w", "content": "sunny"}]}, "messages[0]"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}, {
            "role": "assistant", "tool_calls": [{"id": "c", "function": 5}]}]}, "messages[1]"),
    ],
)  # fmt: skip
def test_unsupported_fields_are_refused_by_name(port: int, core: FakeCore, path: str,
                                                extra: dict[str, Any], param: str) -> None:  # fmt: skip
    body = {"prompt": "hi"} if path == "/v1/completions" else {"messages": CHAT}
    error = error_of(*request(port, "POST", path, {**body, **extra})[::2], 400)
    assert error["param"] == param and error["code"] == "unsupported_parameter"
    assert param.split("[")[0] in error["message"] and not core.submitted


def test_structured_output_reaches_the_engine(client: Any, core: FakeCore) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    for extra, kind, spec in [
        ({"response_format": {"type": "json_object"}}, "json_object", ""),
        ({"response_format": {"type": "json_schema",
                              "json_schema": {"name": "s", "schema": schema}}}, "json", schema),
        ({"extra_body": {"guided_json": json.dumps(schema)}}, "json", schema),
        ({"extra_body": {"guided_regex": "[0-9]+"}}, "regex", "[0-9]+"),
        ({"extra_body": {"guided_choice": ["yes", "no"]}}, "choice", ["yes", "no"]),
        ({"extra_body": {"structured_outputs": {"grammar": 'root ::= "x"'}}}, "grammar",
         'root ::= "x"'),
        ({"response_format": {"type": "text"}}, None, None),
    ]:  # fmt: skip
        client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=1, **extra)
        got = core.submitted[-1].sampling.structured
        if kind is None:
            assert got is None
            continue
        assert got.kind == kind
        assert (json.loads(got.spec) if kind in ("json", "choice") else got.spec) == spec
    with pytest.raises(openai.BadRequestError, match="'yaml' is not one of"):
        client.chat.completions.create(model=MODEL, messages=CHAT,
                                       response_format={"type": "yaml"})  # fmt: skip


def test_tool_choice_none_without_tools_is_accepted(client: Any, core: FakeCore) -> None:
    client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=1, tool_choice="none",
                                   parallel_tool_calls=False)  # fmt: skip
    assert len(core.submitted) == 1


def test_n_choices_with_seeds(client: Any, core: FakeCore, tokenizer: Tokenizer) -> None:
    prompt = "one two three"
    out = client.completions.create(model=MODEL, prompt=[prompt, "four"], n=3, max_tokens=2,
                                    seed=11, temperature=0.8)  # fmt: skip
    assert [c.index for c in out.choices] == list(range(6))
    # each prompt's first choice goes first (its KV then serves the others from the cache)
    assert [g.request_id.rsplit("-", 1)[1] for g in core.submitted[:2]] == ["0", "3"]
    by_index = sorted(core.submitted, key=lambda g: int(g.request_id.rsplit("-", 1)[1]))
    assert [g.sampling.seed for g in by_index] == [11, 12, 13, 11, 12, 13]
    assert [g.prompt_token_ids for g in by_index][:3] == [tokenizer.encode(prompt)] * 3
    # a prompt counts once however many choices it has, as OpenAI counts it
    assert out.usage.prompt_tokens == len(tokenizer.encode(prompt)) + len(tokenizer.encode("four"))
    assert out.usage.completion_tokens == 3 * 2 + 3 * 1
    chunks = list(client.chat.completions.create(model=MODEL, messages=CHAT, n=2, stream=True,
                                                 max_tokens=3, extra_body={"best_of": 2}))  # fmt: skip
    assert {c.choices[0].index for c in chunks if c.choices} == {0, 1}


def test_completion_echo(client: Any, core: FakeCore, tokenizer: Tokenizer) -> None:
    prompt = "Echo me"
    completion = tokenizer.decode(tokenizer.encode(prompt)[:2])
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, echo=True)
    assert out.choices[0].text == prompt + completion
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, echo=True,
                                            stream=True))  # fmt: skip
    assert "".join(c.choices[0].text for c in chunks if c.choices) == prompt + completion
    out = client.completions.create(model=MODEL, prompt=[5, 6, 7], max_tokens=1, echo=True)
    assert out.choices[0].text.startswith(tokenizer.decode([5, 6, 7]))


def test_completion_echo_with_logprobs(client: Any, core: FakeCore, tokenizer: Tokenizer,
                                       port: int) -> None:  # fmt: skip
    """lm-eval's loglikelihood request: the prompt's tokens first (the first without a
    logprob), then the generated one; streamed alike; vLLM's prompt_logprobs field."""
    ids = [[5, 6, 7], [8, 9]]
    out = client.completions.create(model=MODEL, prompt=ids, max_tokens=1, logprobs=1,
                                    echo=True, temperature=0, seed=1234)  # fmt: skip
    assert core.submitted[-1].sampling.prompt_logprobs == 1
    for choice in out.choices:
        prompt = ids[choice.index]
        lp = choice.logprobs
        text = [tokenizer.decode([t], skip_special_tokens=False) for t in prompt]
        assert lp.tokens == text + text[:1]  # the fake core answers the prompt's first token
        # the generated token: fake_logprobs at i=0 with seed 1234
        assert lp.token_logprobs == [None] + [-k / 10 for k in range(1, len(prompt))] + [-4.0]
        assert lp.top_logprobs[0] is None and len(lp.top_logprobs) == len(prompt) + 1
        assert all(lp.tokens[k] in lp.top_logprobs[k] for k in range(1, len(prompt) + 1))
        assert choice.text.startswith(tokenizer.decode(prompt))
    body = {"model": MODEL, "prompt": "Echo me", "max_tokens": 2, "logprobs": 2, "echo": True}
    whole = client.completions.create(**body).choices[0]
    chunks = [c.choices[0] for c in client.completions.create(**body, stream=True) if c.choices]
    assert "".join(c.text for c in chunks) == whole.text
    streamed = [v for c in chunks if c.logprobs for v in c.logprobs.token_logprobs]
    assert streamed == whole.logprobs.token_logprobs
    # max_tokens 0: the prompt scored, nothing generated (streamed alike)
    for stream in (False, True):
        body = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 0, "logprobs": 1, "echo": True}
        if stream:
            chunks = [c for c in client.completions.create(**body, stream=True,
                      stream_options={"include_usage": True})]  # fmt: skip
            usage = chunks[-1].usage
            choices = [c.choices[0] for c in chunks if c.choices]
            text = "".join(c.text for c in choices)
            lps = [v for c in choices if c.logprobs for v in c.logprobs.token_logprobs]
            reason = choices[-1].finish_reason
        else:
            out = client.completions.create(**body)
            usage, text, reason = out.usage, out.choices[0].text, out.choices[0].finish_reason
            lps = out.choices[0].logprobs.token_logprobs
        assert text == tokenizer.decode([5, 6, 7]) and lps == [None, -0.1, -0.2]
        assert (usage.prompt_tokens, usage.completion_tokens, reason) == (3, 0, "length")
    assert core.submitted[-1].sampling.max_tokens == 1
    error = error_of(*request(port, "POST", "/v1/completions",
                              {"prompt": "x", "max_tokens": 0})[::2], 400)  # fmt: skip
    assert error["param"] == "max_tokens"
    raw = client.completions.with_raw_response.create(
        model=MODEL, prompt=[5, 6, 7], max_tokens=1, extra_body={"prompt_logprobs": 1}
    ).http_response.json()["choices"][0]  # fmt: skip
    assert raw["logprobs"] is None
    assert raw["prompt_logprobs"][0] is None
    assert raw["prompt_logprobs"][1] == {
        "7": {
            "logprob": -1.1,
            "rank": 1,
            "decoded_token": tokenizer.decode([7], skip_special_tokens=False),
        },
        "6": {
            "logprob": -0.1,
            "rank": None,
            "decoded_token": tokenizer.decode([6], skip_special_tokens=False),
        },
    }


def test_chat_echo_and_continue_final_message(
    client: Any, core: FakeCore, tokenizer: Tokenizer
) -> None:
    messages = [{"role": "user", "content": "Name a color."},
                {"role": "assistant", "content": "The color is"}]  # fmt: skip
    out = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=1,
        extra_body={"echo": True, "continue_final_message": True,
                    "add_generation_prompt": False},
    )  # fmt: skip
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=False)
    cut = rendered[: rendered.rindex("The color is") + len("The color is")]
    ids = tokenizer.encode(cut, add_special_tokens=False)
    assert core.submitted[-1].prompt_token_ids == ids  # the turn is left open
    assert out.choices[0].message.content.startswith("The color is")
    client.chat.completions.create(model=MODEL, messages=messages[:1], max_tokens=1,
                                   extra_body={"add_generation_prompt": False})  # fmt: skip
    assert core.submitted[-1].prompt_token_ids == tokenizer.encode_chat(messages[:1], False)


def test_chat_template_kwargs(port: int, core: FakeCore) -> None:
    body = {"messages": CHAT, "max_tokens": 1, "chat_template_kwargs": {"enable_thinking": False}}
    assert request(port, "POST", "/v1/chat/completions", body)[0] == 200
    body["chat_template_kwargs"] = {"messages": []}
    error = error_of(*request(port, "POST", "/v1/chat/completions", body)[::2], 400)
    assert error["param"] == "chat_template_kwargs"


def test_template_kwargs_reach_the_template(tokenizer: Tokenizer) -> None:
    from tokenizers import Tokenizer as HFTokenizer

    backend = HFTokenizer.from_str(tokenizer._backend.to_str())
    template = "{{ greeting }}{% for m in messages %}{{ m.content }}{% endfor %}"
    custom = Tokenizer(backend, {}, template, [])
    assert custom.apply_chat_template(CHAT, template_kwargs={"greeting": "hey "}) == "hey x"
    assert custom.apply_chat_template(CHAT, template_kwargs={"messages": []}) == "x"


# -- served model names, API key, tokenize / detokenize / version ---------------------------


@pytest.fixture
def keyed(core: FakeCore) -> Iterator[int]:
    server = Server(core, served_model_names=["alpha", "beta"], api_key="s3cret")
    yield server.port
    server.stop()


def test_served_model_names_and_api_key(keyed: int, core: FakeCore) -> None:
    base = f"http://127.0.0.1:{keyed}/v1"
    client = openai.OpenAI(base_url=base, api_key="s3cret", max_retries=0)
    assert [m.id for m in client.models.list().data] == ["alpha", "beta"]
    assert client.completions.create(model="beta", prompt="hi", max_tokens=1).model == "beta"
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=1)
    assert e.value.body["code"] == "model_not_found"
    assert error_of(*request(keyed, "GET", "/v1/models/gamma", headers={
        "Authorization": "Bearer s3cret"})[::2], 404)["code"] == "model_not_found"  # fmt: skip
    wrong = openai.OpenAI(base_url=base, api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()
    error = error_of(*request(keyed, "POST", "/v1/completions", {"prompt": "hi"})[::2], 401)
    assert error["code"] == "invalid_api_key" and "s3cret" not in error["message"]
    assert request(keyed, "GET", "/health")[0] == 200  # probes and scrapers need no key
    assert request(keyed, "GET", "/metrics")[0] == 200
    assert len(core.submitted) == 1


def test_tokenize_detokenize_version(port: int, tokenizer: Tokenizer) -> None:
    status, _, data = request(port, "POST", "/tokenize", {"prompt": "Hello world"})
    out = json.loads(data)
    ids = tokenizer.encode("Hello world")
    assert status == 200 and out["tokens"] == ids and out["count"] == len(ids)
    assert out["max_model_len"] == FakeCore.max_model_len and out["token_strs"] is None
    body = {"messages": CHAT, "return_token_strs": True}
    out = json.loads(request(port, "POST", "/tokenize", body)[2])
    assert out["tokens"] == tokenizer.encode_chat(CHAT) and len(out["token_strs"]) == out["count"]
    out = json.loads(request(port, "POST", "/detokenize", {"tokens": ids})[2])
    assert out == {"prompt": tokenizer.decode(ids)}
    error_of(*request(port, "POST", "/detokenize", {"tokens": [10**7]})[::2], 400)
    error_of(*request(port, "POST", "/tokenize", {"prompt": "x", "model": "other"})[::2], 404)
    # found by schemathesis: nothing to continue was a 500
    empty = {"messages": [], "continue_final_message": True}
    assert error_of(*request(port, "POST", "/tokenize", empty)[::2], 400)["param"] == "messages"
    status, _, data = request(port, "GET", "/version")
    assert status == 200 and json.loads(data)["version"]


def test_logprobs_in_openai_shapes(client: Any, core: FakeCore, tokenizer: Tokenizer) -> None:
    def text(t: int) -> str:
        return tokenizer.decode([t], skip_special_tokens=False)

    prompt = "Logprobs please"
    ids = tokenizer.encode(prompt)[:3]
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, logprobs=2)
    assert core.submitted[-1].sampling.logprobs == 2
    lp = out.choices[0].logprobs
    assert lp.tokens == [text(t) for t in ids] and lp.token_logprobs == [0.0, -0.1, -0.2]
    assert lp.top_logprobs[1] == {text(ids[1] + 1): -1.1, text(ids[1] + 2): -2.1,
                                  text(ids[1]): -0.1}  # the chosen one always there  # fmt: skip
    assert lp.text_offset == [0, len(text(ids[0])), len(text(ids[0])) + len(text(ids[1]))]
    messages = [{"role": "user", "content": "Hi"}]
    chat_ids = tokenizer.encode_chat(messages)[:2]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2,
                                          logprobs=True, top_logprobs=1)  # fmt: skip
    content = chat.choices[0].logprobs.content
    assert [c.token for c in content] == [text(t) for t in chat_ids]
    assert content[1].logprob == -0.1 and content[1].bytes == list(text(chat_ids[1]).encode())
    assert [(t.token, t.logprob) for t in content[1].top_logprobs] == [
        (text(chat_ids[1] + 1), -1.1)
    ]
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2,
                                                 logprobs=True, stream=True))  # fmt: skip
    streamed = [c for ch in chunks if ch.choices and ch.choices[0].logprobs
                for c in ch.choices[0].logprobs.content]  # fmt: skip
    assert [c.token for c in streamed] == [text(t) for t in chat_ids]
    assert all(c.top_logprobs == [] for c in streamed)  # logprobs alone: no alternatives
    plain = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2)
    assert plain.choices[0].logprobs is None and core.submitted[-1].sampling.logprobs is None


def test_best_of_answers_the_most_likely(client: Any, core: FakeCore) -> None:
    # seeds 13, 14, 15 -> the fake's logprobs -3, -4, -0 per token: candidates 2, 0 win
    out = client.completions.create(model=MODEL, prompt="a b c d", max_tokens=3, n=2, seed=13,
                                    logprobs=0, extra_body={"best_of": 3})  # fmt: skip
    assert [c.logprobs.token_logprobs[0] for c in out.choices] == [0.0, -3.0]
    assert [c.index for c in out.choices] == [0, 1]
    out = client.completions.create(model=MODEL, prompt="a b c d", max_tokens=4, n=2,
                                    extra_body={"best_of": 3})  # fmt: skip
    assert all(g.sampling.logprobs == 0 for g in core.submitted[-3:])
    assert [c.index for c in out.choices] == [0, 1]
    assert all(c.logprobs is None for c in out.choices)  # not asked for: not shown
    assert out.usage.completion_tokens == 3 * 4  # every candidate was generated


def test_cors_off_by_default_and_on_for_allowed_origins(port: int, core: FakeCore) -> None:
    origin = {"Origin": "https://app.example"}
    _, headers, _ = request(port, "GET", "/v1/models", headers=origin)
    assert "Access-Control-Allow-Origin" not in headers
    server = Server(core, allowed_origins=["https://app.example"], api_key="k")
    try:
        preflight = {**origin, "Access-Control-Request-Method": "POST",
                     "Access-Control-Request-Headers": "authorization, content-type"}  # fmt: skip
        status, headers, _ = request(server.port, "OPTIONS", "/v1/completions", headers=preflight)
        assert status == 204 and headers["Access-Control-Allow-Origin"] == "https://app.example"
        assert "POST" in headers["Access-Control-Allow-Methods"]
        assert headers["Access-Control-Allow-Headers"] == "authorization, content-type"
        body = {"prompt": "hi", "max_tokens": 1, "stream": True}
        auth = {**origin, "Authorization": "Bearer k"}
        status, headers, _ = request(server.port, "POST", "/v1/completions", body, auth)
        assert status == 200 and headers["Access-Control-Allow-Origin"] == "https://app.example"
        status, headers, _ = request(server.port, "GET", "/v1/models", headers=origin)
        assert status == 401 and headers["Access-Control-Allow-Origin"]  # readable errors
        other = {"Origin": "https://evil.example", "Access-Control-Request-Method": "POST"}
        assert request(server.port, "OPTIONS", "/v1/completions", headers=other)[0] == 403
        _, headers, _ = request(
            server.port, "GET", "/health", headers={"Origin": "https://evil.example"}
        )
        assert "Access-Control-Allow-Origin" not in headers
    finally:
        server.stop()
