"""The OpenAI-compatible HTTP API, behind a real aiohttp server, against a fake core.

The fake core echoes the prompt's tokens back (so expected text is known exactly) and
can be told to overload, fail, or go slowly (for disconnects). Well-formed requests go
through the official `openai` SDK, because SDK compatibility is the point; error cases
go through raw HTTP so that status codes and bodies are seen as they are.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from pdserve.common.model.checkpoint.tokenizer import Tokenizer
from pdserve.services.router import openapi
from tests import http_fakes
from tests.http_fakes import (
    CHAT,
    MODEL,
    OPENAPI_PATH,
    FakeCore,
    Server,
    error_of,
    request,
)

openai = pytest.importorskip("openai")

# The fixtures: one server over the fake core per module; `core` resets it per test.
server_core, core, port, client, tokenizer = (
    http_fakes.server_core,
    http_fakes.core,
    http_fakes.port,
    http_fakes.client,
    http_fakes.tokenizer,
)


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


def test_each_of_several_api_keys_names_its_client(core: FakeCore) -> None:
    """Behind a proxy every user has one address: with a key each, fair admission tells
    them apart by key (its index; the key itself is never used as a name)."""
    server = Server(core, api_key=["alice-key", "bob-key"])
    try:
        for key in ("alice-key", "bob-key", "alice-key"):
            status, _, data = request(server.port, "POST", "/v1/completions",
                                      {"prompt": "hi", "max_tokens": 1},
                                      {"Authorization": f"Bearer {key}"})  # fmt: skip
            assert status == 200, data
        error = error_of(*request(server.port, "POST", "/v1/completions", {"prompt": "hi"},
                                  {"Authorization": "Bearer carol"})[::2], 401)  # fmt: skip
        assert error["code"] == "invalid_api_key"
        assert core.owners == ["key:0", "key:1", "key:0"]
    finally:
        server.stop()


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
