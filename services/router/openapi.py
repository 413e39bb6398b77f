"""The OpenAPI 3.1 document of the router's HTTP API, built from openai_schema's Structs
(so it cannot drift from what the server decodes).

openapi.json, next to this file, is the generic document:
``python -m pdserve.services.router.openapi > services/router/openapi.json``
(a test fails when it is stale). The router serves ``openapi(models, max_model_len,
vocab_size)`` at /openapi.json: the same document narrowed to its models, so that a
fuzzer (schemathesis) sends requests this deployment can accept.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import msgspec

from pdserve.services.router.openai_schema import (
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    Completion,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorBody,
    Health,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
    Version,
)


def _prompt_schema(vocab_size: int | None) -> dict[str, Any]:
    token: dict[str, Any] = {"type": "integer", "minimum": 0}
    if vocab_size is not None:
        token["maximum"] = vocab_size - 1
    tokens = {"type": "array", "items": token, "minItems": 1}
    text = {"type": "string", "minLength": 1}
    return {"anyOf": [text, {"type": "array", "items": text, "minItems": 1}, tokens,
                      {"type": "array", "items": tokens, "minItems": 1}]}  # fmt: skip


_SCHEMA_TYPES: tuple[type, ...] = (
    CompletionRequest, ChatCompletionRequest, Completion, ChatCompletion,
    ChatCompletionChunk, ModelList, ModelCard, ErrorBody, Health, TokenizeRequest,
    TokenizeResponse, DetokenizeRequest, DetokenizeResponse, Version,
)  # fmt: skip
_ERROR_STATUSES = {
    "400": "invalid request: malformed JSON, a bad field, a field not supported",
    "401": "a wrong or missing API key (when the server has one)",
    "404": "no such route, or a model not served here (code model_not_found)",
    "405": "wrong method for this route",
    "413": "request body too large",
    "429": "overloaded before the first token; retry later (Retry-After)",
    "500": "internal error",
    "503": "a service the request needs is down",
}


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def _json_of(name: str, why: str) -> dict[str, Any]:
    return {"description": why, "content": {"application/json": {"schema": _ref(name)}}}


def _errors() -> dict[str, Any]:
    body = {"application/json": {"schema": _ref("ErrorBody")}}
    return {code: {"description": why, "content": body} for code, why in _ERROR_STATUSES.items()}


def _sse_event(chunk: str) -> dict[str, Any]:
    # One event as OpenAPI 3.1 tools read it: `data` is [DONE] or a JSON chunk or error.
    payload = {"contentMediaType": "application/json",
               "contentSchema": {"anyOf": [_ref(chunk), _ref("ErrorBody")]}}  # fmt: skip
    data = {"type": "string", "if": {"const": "[DONE]"}, "else": payload}
    return {"type": "object", "required": ["data"], "properties": {"data": data}}


def _generate_op(request: str, response: str, chunk: str, summary: str) -> dict[str, Any]:
    return {
        "summary": summary,
        "parameters": [
            {"name": "x-request-id", "in": "header", "required": False,
             "schema": {"type": "string"}, "description": "echoed back; names the request"},
        ],
        "requestBody": {
            "required": True, "content": {"application/json": {"schema": _ref(request)}},
        },
        "responses": {
            "200": {
                "description": "the answer; with stream=true, server-sent events ending in [DONE]",
                "content": {
                    "application/json": {"schema": _ref(response)},
                    "text/event-stream": {"schema": _sse_event(chunk)},
                },
            },
            **_errors(),
        },
    }  # fmt: skip


def _plain_op(request: str, response: str, summary: str) -> dict[str, Any]:
    return {
        "summary": summary,
        "requestBody": {
            "required": True, "content": {"application/json": {"schema": _ref(request)}},
        },
        "responses": {"200": _json_of(response, summary), **_errors()},
    }  # fmt: skip


def openapi(models: list[str] | str | None = None, max_model_len: int | None = None,
            vocab_size: int | None = None) -> dict[str, Any]:  # fmt: skip
    """The document; given the served model, its length and vocabulary, as exact as a
    schema can be for one deployment (what the router serves at /openapi.json)."""
    _, components = msgspec.json.schema_components(
        _SCHEMA_TYPES, ref_template="#/components/schemas/{name}"
    )
    components["CompletionRequest"]["properties"]["prompt"] = _prompt_schema(vocab_size)
    for name in ("CompletionRequest", "ChatCompletionRequest"):
        fields = components[name]["properties"]
        if models is not None:
            names = [models] if isinstance(models, str) else list(models)
            fields["model"]["anyOf"] = [{"enum": names}, {"type": "null"}]
        if max_model_len is not None:
            for field in ("max_tokens", "max_completion_tokens"):
                if field in fields:
                    fields[field]["anyOf"][0]["maximum"] = max_model_len - 1
    text = {"description": "Prometheus text format 0.0.4",
            "content": {"text/plain": {"schema": {"type": "string"}}}}  # fmt: skip
    return {
        "openapi": "3.1.0",
        "info": {"title": "pdserve router", "version": "1"},
        "paths": {
            "/v1/models": {"get": {"summary": "the served model",
                                   "responses": {"200": _json_of("ModelList", "models")}}},
            "/v1/models/{model}": {"get": {"summary": "one model", "parameters": [
                {"name": "model", "in": "path", "required": True, "schema": {"type": "string"}}],
                "responses": {"200": _json_of("ModelCard", "the model"),
                              "404": _json_of("ErrorBody", "not served here")}}},
            "/v1/completions": {"post": _generate_op(
                "CompletionRequest", "Completion", "Completion", "text completion")},
            "/v1/chat/completions": {"post": _generate_op(
                "ChatCompletionRequest", "ChatCompletion", "ChatCompletionChunk", "chat")},
            "/tokenize": {"post": _plain_op("TokenizeRequest", "TokenizeResponse",
                                            "token ids of a prompt or of rendered messages")},
            "/detokenize": {"post": _plain_op("DetokenizeRequest", "DetokenizeResponse",
                                              "the text of token ids")},
            "/version": {"get": {"summary": "the server's version",
                                 "responses": {"200": _json_of("Version", "version")}}},
            "/health": {"get": {"summary": "ready to serve?", "responses": {
                "200": _json_of("Health", "every routed service is ready"),
                "503": _json_of("Health", "some service is not ready; detail says which"),
            }}},
            "/metrics": {"get": {"summary": "Prometheus metrics", "responses": {"200": text}}},
        },
        "components": {"schemas": components},
    }  # fmt: skip


if __name__ == "__main__":  # regenerate openapi.json
    json.dump(openapi(), sys.stdout, indent=2, sort_keys=True)
    sys.stdout.write("\n")
