"""The HTTP API's errors over raw HTTP, against the fake core: OpenAI's error body with the
status a client can act on (400 naming the field, 429, 503 with Retry-After, 500 with no
traceback), failures mid-stream, and a client that goes away aborting its request."""

from __future__ import annotations

import json
import socket
import time
from typing import Any

import pytest

from tests import http_fakes
from tests.http_fakes import (
    FakeCore,
    error_of,
    request,
    sse_events,
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
