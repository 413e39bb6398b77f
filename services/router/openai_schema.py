"""OpenAI-compatible request and response bodies, as msgspec Structs.

Requests are decoded straight into these types, so a wrong type or an out-of-range
value is a 400 whose message names the field (msgspec says "... - at `$.max_tokens`").
Unknown fields are ignored, as OpenAI and vLLM do: SDKs send fields like `user` or
`metadata` that change nothing here. Known fields that this server cannot honour
(n > 1, echo, logprobs, penalties, tools, ...) are refused by ``unsupported()`` rather
than silently ignored, because ignoring them would return a different answer from the
one asked for.

``openapi()`` builds the OpenAPI document from these same types, so the schema that
fuzzers read cannot drift from what the server decodes; openapi.json is its output
(``python -m pdserve.services.router.openai_schema > services/router/openapi.json``).
"""

from __future__ import annotations

import json
import sys
import time
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from pdserve.common.sampling import SamplingParams

TokenId = Annotated[int, Meta(ge=0)]
Count = Annotated[int, Meta(ge=1)]
Seed = Annotated[int, Meta(ge=-(2**63), le=2**63 - 1)]  # what torch's manual_seed takes
_TOKEN_LIST: dict[str, Any] = {"type": "array", "items": {"type": "integer", "minimum": 0}}
# msgspec can only hold one array type in a union, so the decoded type is looser
# (a list of str | int | list[int]) and the handler checks the list is homogeneous;
# the schema states the four shapes OpenAI accepts.
PROMPT_SCHEMA: dict[str, Any] = {
    "anyOf": [
        {"type": "string"},
        {"type": "array", "items": {"type": "string"}, "minItems": 1},
        {**_TOKEN_LIST, "minItems": 1},
        {"type": "array", "items": {**_TOKEN_LIST, "minItems": 1}, "minItems": 1},
    ]
}
Prompt = Annotated[
    str | Annotated[list[str | TokenId | Annotated[list[TokenId], Meta(min_length=1)]], Meta(min_length=1)],
    Meta(extra_json_schema=PROMPT_SCHEMA),
]


class StreamOptions(msgspec.Struct, kw_only=True):
    include_usage: bool = False


class ResponseFormat(msgspec.Struct, kw_only=True):
    type: str = "text"


class _SamplingRequest(msgspec.Struct, kw_only=True):
    """Fields shared by completions and chat completions."""

    model: str | None = None  # absent: the served model
    max_tokens: Count | None = None
    temperature: Annotated[float, Meta(ge=0.0, le=2.0)] = 1.0  # OpenAI's default and range
    top_p: Annotated[float, Meta(gt=0.0, le=1.0)] = 1.0
    top_k: Annotated[int, Meta(ge=-1)] = 0  # extension (vLLM's); 0 or -1: off
    seed: Seed | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] | None = None  # extension (vLLM's)
    ignore_eos: bool = False  # extension (vLLM's)
    n: Count = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None

    def _common_unsupported(self) -> tuple[str, str] | None:
        if self.n != 1:
            return "n", f"n={self.n} is not supported: only one choice per prompt (n=1)"
        if self.presence_penalty or self.frequency_penalty:
            name = "presence_penalty" if self.presence_penalty else "frequency_penalty"
            return name, f"{name} is not supported; leave it at 0"
        if self.logit_bias:
            return "logit_bias", "logit_bias is not supported"
        return None

    def sampling(self, max_tokens: int) -> SamplingParams:
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=self.temperature,
            top_k=self.top_k,
            top_p=self.top_p,
            seed=self.seed,
            stop=stop,
            stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=self.ignore_eos,
        )

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_SamplingRequest, kw_only=True):
    prompt: Prompt
    echo: bool = False
    logprobs: int | None = None
    best_of: Count | None = None
    suffix: str | None = None

    def unsupported(self) -> tuple[str, str] | None:
        """(param, message) for the first field set to something this server cannot do."""
        if self.echo:
            return "echo", "echo is not supported"
        if self.logprobs is not None:
            return "logprobs", "logprobs are not supported"
        if self.best_of not in (None, 1):
            return "best_of", "best_of > 1 is not supported"
        if self.suffix:
            return "suffix", "suffix is not supported"
        return self._common_unsupported()


class ContentPart(msgspec.Struct, kw_only=True):
    type: str
    text: str | None = None


class ChatMessageIn(msgspec.Struct, kw_only=True):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None


class ChatCompletionRequest(_SamplingRequest, kw_only=True):
    messages: Annotated[list[ChatMessageIn], Meta(min_length=1)]
    max_completion_tokens: Count | None = None  # OpenAI's newer name; wins over max_tokens
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    response_format: ResponseFormat | None = None

    def unsupported(self) -> tuple[str, str] | None:
        if self.logprobs or self.top_logprobs:
            return "logprobs", "logprobs are not supported"
        if self.tools:
            return "tools", "tool calling is not supported"
        if self.response_format is not None and self.response_format.type != "text":
            return "response_format", "only response_format type 'text' is supported"
        return self._common_unsupported()

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


# -- responses ----------------------------------------------------------------------------


class PromptTokensDetails(msgspec.Struct, kw_only=True):
    cached_tokens: int = 0


class UsageInfo(msgspec.Struct, kw_only=True, omit_defaults=True):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None  # only when some were cached


class CompletionChoice(msgspec.Struct, kw_only=True):
    index: int
    text: str
    finish_reason: str | None  # stop | length | abort; null in a stream until the end
    logprobs: None = None


class Completion(msgspec.Struct, kw_only=True):
    id: str
    object: str  # text_completion
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None  # always set, except on stream chunks


class ChatMessageOut(msgspec.Struct, kw_only=True):
    role: str
    content: str


class ChatChoice(msgspec.Struct, kw_only=True):
    index: int
    message: ChatMessageOut
    finish_reason: str
    logprobs: None = None


class ChatCompletion(msgspec.Struct, kw_only=True):
    id: str
    object: str  # chat.completion
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo


class Delta(msgspec.Struct, kw_only=True, omit_defaults=True):
    role: str | None = None
    content: str | None = None


class ChatChunkChoice(msgspec.Struct, kw_only=True):
    index: int
    delta: Delta
    finish_reason: str | None = None
    logprobs: None = None


class ChatCompletionChunk(msgspec.Struct, kw_only=True):
    id: str
    object: str  # chat.completion.chunk
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None  # set only on the last chunk, when include_usage


class ModelCard(msgspec.Struct, kw_only=True):
    id: str
    object: str  # model
    created: int
    owned_by: str
    max_model_len: int


class ModelList(msgspec.Struct, kw_only=True):
    object: str  # list
    data: list[ModelCard]


class ErrorDetail(msgspec.Struct, kw_only=True):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorBody(msgspec.Struct, kw_only=True):
    error: ErrorDetail


class Health(msgspec.Struct, kw_only=True, omit_defaults=True):
    status: str  # ok | unavailable
    detail: dict[str, Any] | None = None


# -- rendering the core's events -----------------------------------------------------------


class Renderer:
    """Turns generated text into one endpoint's bodies and stream chunks."""

    def __init__(self, request_id: str, model: str) -> None:
        self.request_id = request_id
        self.model = model
        self.created = int(time.time())

    def start(self, index: int) -> msgspec.Struct | None:
        return None

    def delta(self, index: int, text: str) -> msgspec.Struct:
        raise NotImplementedError

    def finish(self, index: int, finish_reason: str) -> msgspec.Struct:
        raise NotImplementedError

    def usage_chunk(self, usage: UsageInfo) -> msgspec.Struct:
        raise NotImplementedError

    def body(self, texts: list[str], reasons: list[str], usage: UsageInfo) -> msgspec.Struct:
        raise NotImplementedError


class CompletionRenderer(Renderer):
    def _chunk(self, choices: list[CompletionChoice], usage: UsageInfo | None = None) -> Completion:
        return Completion(id=self.request_id, object="text_completion", created=self.created,
                          model=self.model, choices=choices, usage=usage)  # fmt: skip

    def delta(self, index: int, text: str) -> Completion:
        return self._chunk([CompletionChoice(index=index, text=text, finish_reason=None)])

    def finish(self, index: int, finish_reason: str) -> Completion:
        return self._chunk([CompletionChoice(index=index, text="", finish_reason=finish_reason)])

    def usage_chunk(self, usage: UsageInfo) -> Completion:
        return self._chunk([], usage)

    def body(self, texts: list[str], reasons: list[str], usage: UsageInfo) -> Completion:
        choices = [
            CompletionChoice(index=i, text=text, finish_reason=reason)
            for i, (text, reason) in enumerate(zip(texts, reasons))
        ]
        return self._chunk(choices, usage)


class ChatRenderer(Renderer):
    def _chunk(
        self, choices: list[ChatChunkChoice], usage: UsageInfo | None = None
    ) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=self.request_id, object="chat.completion.chunk",
                                   created=self.created, model=self.model, choices=choices,
                                   usage=usage)  # fmt: skip

    def start(self, index: int) -> ChatCompletionChunk:
        # OpenAI's first chunk names the role; clients key their message assembly on it.
        return self._chunk([ChatChunkChoice(index=index, delta=Delta(role="assistant", content=""))])

    def delta(self, index: int, text: str) -> ChatCompletionChunk:
        return self._chunk([ChatChunkChoice(index=index, delta=Delta(content=text))])

    def finish(self, index: int, finish_reason: str) -> ChatCompletionChunk:
        return self._chunk([ChatChunkChoice(index=index, delta=Delta(), finish_reason=finish_reason)])

    def usage_chunk(self, usage: UsageInfo) -> ChatCompletionChunk:
        return self._chunk([], usage)

    def body(self, texts: list[str], reasons: list[str], usage: UsageInfo) -> ChatCompletion:
        choices = [
            ChatChoice(index=i, message=ChatMessageOut(role="assistant", content=text),
                       finish_reason=reason)
            for i, (text, reason) in enumerate(zip(texts, reasons))
        ]  # fmt: skip
        return ChatCompletion(id=self.request_id, object="chat.completion", created=self.created,
                              model=self.model, choices=choices, usage=usage)  # fmt: skip


# -- OpenAPI ------------------------------------------------------------------------------

_SCHEMA_TYPES: tuple[type, ...] = (
    CompletionRequest, ChatCompletionRequest, Completion, ChatCompletion,
    ChatCompletionChunk, ModelList, ModelCard, ErrorBody, Health,
)  # fmt: skip
_ERROR_STATUSES = {
    "400": "invalid request: malformed JSON, a bad field, an unknown model",
    "404": "no such route",
    "405": "wrong method for this route",
    "413": "request body too large",
    "429": "overloaded before the first token; retry later (Retry-After)",
    "500": "internal error",
    "503": "a service the request needs is down",
}


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def _errors() -> dict[str, Any]:
    body = {"application/json": {"schema": _ref("ErrorBody")}}
    return {code: {"description": why, "content": body} for code, why in _ERROR_STATUSES.items()}


def _generate_op(request: str, response: str, summary: str) -> dict[str, Any]:
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
                    "text/event-stream": {"schema": {"type": "string"}},
                },
            },
            **_errors(),
        },
    }  # fmt: skip


def openapi() -> dict[str, Any]:
    _, components = msgspec.json.schema_components(
        _SCHEMA_TYPES, ref_template="#/components/schemas/{name}"
    )
    json_of = lambda name, why: {
        "description": why, "content": {"application/json": {"schema": _ref(name)}},
    }  # fmt: skip
    text = {"description": "Prometheus text format 0.0.4",
            "content": {"text/plain": {"schema": {"type": "string"}}}}  # fmt: skip
    return {
        "openapi": "3.1.0",
        "info": {"title": "pdserve router", "version": "1"},
        "paths": {
            "/v1/models": {"get": {"summary": "the served model",
                                   "responses": {"200": json_of("ModelList", "models")}}},
            "/v1/completions": {"post": _generate_op("CompletionRequest", "Completion",
                                                     "text completion")},
            "/v1/chat/completions": {"post": _generate_op("ChatCompletionRequest",
                                                          "ChatCompletion", "chat completion")},
            "/health": {"get": {"summary": "ready to serve?", "responses": {
                "200": json_of("Health", "every routed service is ready"),
                "503": json_of("Health", "some service is not ready; detail says which"),
            }}},
            "/metrics": {"get": {"summary": "Prometheus metrics", "responses": {"200": text}}},
        },
        "components": {"schemas": components},
    }  # fmt: skip


if __name__ == "__main__":
    json.dump(openapi(), sys.stdout, indent=2, sort_keys=True)
    sys.stdout.write("\n")
