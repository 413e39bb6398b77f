"""OpenAI-compatible request and response bodies, as msgspec Structs.

Requests are decoded straight into these types, so a wrong type or an out-of-range
value is a 400 whose message names the field (msgspec says "... - at `$.max_tokens`").
Unknown fields are ignored, as OpenAI and vLLM do: SDKs send fields like `user` or
`metadata` that change nothing here. Known fields that this server cannot honour
(n > 1, echo, logprobs, penalties, tools, ...) are refused by ``unsupported()`` rather
than silently ignored, because ignoring them would return a different answer from the
one asked for.

openapi.py builds the OpenAPI document from these same types, so the schema that
fuzzers read cannot drift from what the server decodes.
"""

from __future__ import annotations

import abc
import time
from typing import Annotated, Any, Literal, TypeVar

import msgspec
from msgspec import Meta

from pdserve.common.engine.sampling_params import SamplingParams
from pdserve.common.runtime.protocol import Usage

T = TypeVar("T")

TokenId = Annotated[int, Meta(ge=0)]
NonNegative = Annotated[int, Meta(ge=0)]
Text = Annotated[str, Meta(min_length=1)]


def only(schema: dict[str, Any]) -> Meta:
    """A field this server takes only at its default: the schema says so (fuzzers then
    send what is supported), the handler refuses other values with a clear message."""
    return Meta(extra_json_schema=schema, description="not supported beyond this value")


Count = Annotated[int, Meta(ge=1)]
Seed = Annotated[int, Meta(ge=-(2**63), le=2**63 - 1)]  # what torch's manual_seed takes
# msgspec can only hold one array type in a union, so the decoded type is looser
# (a list of str | int | list[int]) and the handler checks the list is homogeneous;
# the OpenAPI document (openapi.py) states the four shapes OpenAI accepts.
Prompt = Text | Annotated[list[Text | TokenId | Annotated[list[TokenId], Meta(min_length=1)]],
                          Meta(min_length=1)]  # fmt: skip


def _integral_floats_as_ints(value: Any) -> Any:
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, list):
        return [_integral_floats_as_ints(v) for v in value]
    if isinstance(value, dict):
        return {k: _integral_floats_as_ints(v) for k, v in value.items()}
    return value


def decode_request(body: bytes, kind: type[T]) -> T:
    """Strict decoding, raising msgspec's DecodeError / ValidationError (which name the
    field), except that an integral float is taken for an int."""
    try:
        return _decode_request(body, kind)
    except RecursionError:  # [[[[...]]]] anywhere, even in a field that is skipped
        raise msgspec.DecodeError("the JSON is nested too deeply") from None


def _decode_request(body: bytes, kind: type[T]) -> T:
    try:
        return msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as exc:
        if "got `float`" not in str(exc):
            raise
    # JSON has one number type, and JSON Schema counts 16.0 as an integer: accept it, but
    # nothing looser (no "16" strings). A slow path, taken only for such bodies.
    return msgspec.convert(_integral_floats_as_ints(msgspec.json.decode(body)), kind)


class StreamOptions(msgspec.Struct, kw_only=True):
    include_usage: bool = False


class ResponseFormat(msgspec.Struct, kw_only=True):
    type: Literal["text"] = "text"  # json_object / json_schema: not supported


class SamplingRequest(msgspec.Struct, kw_only=True):
    """Fields shared by completions and chat completions."""

    model: str | None = None  # absent: the served model
    max_tokens: Count | None = None
    temperature: Annotated[float, Meta(ge=0.0, le=2.0)] = 1.0  # OpenAI's default and range
    top_p: Annotated[float, Meta(gt=0.0, le=1.0)] = 1.0
    top_k: Annotated[int, Meta(ge=-1)] = 0  # extension (vLLM's); 0 or -1: off
    seed: Seed | None = None
    stop: Text | list[Text] | None = None
    stop_token_ids: list[TokenId] | None = None  # extension (vLLM's)
    ignore_eos: bool = False  # extension (vLLM's)
    n: Annotated[int, Meta(ge=1), only({"maximum": 1})] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: Annotated[float, only({"const": 0})] = 0.0
    frequency_penalty: Annotated[float, only({"const": 0})] = 0.0
    logit_bias: Annotated[dict[str, float] | None, only({"maxProperties": 0})] = None
    user: str | None = None

    def _common_unsupported(self) -> tuple[str, str] | None:  # (param, message)
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


class CompletionRequest(SamplingRequest, kw_only=True):
    prompt: Prompt
    echo: Annotated[bool, only({"const": False})] = False
    logprobs: Annotated[int | None, only({"type": "null"})] = None
    best_of: Annotated[Count | None, only({"maximum": 1})] = None
    suffix: Annotated[str | None, only({"maxLength": 0})] = None

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


class ChatCompletionRequest(SamplingRequest, kw_only=True):
    messages: Annotated[list[ChatMessageIn], Meta(min_length=1)]
    max_completion_tokens: Count | None = None  # OpenAI's newer name; wins over max_tokens
    logprobs: Annotated[bool, only({"const": False})] = False
    top_logprobs: Annotated[NonNegative | None, only({"maximum": 0})] = None
    tools: Annotated[list[Any] | None, only({"maxItems": 0})] = None
    response_format: ResponseFormat | None = None

    def unsupported(self) -> tuple[str, str] | None:
        if self.logprobs or self.top_logprobs:
            return "logprobs", "logprobs are not supported"
        if self.tools:
            return "tools", "tool calling is not supported"
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


def usage_of(usages: list[Usage]) -> UsageInfo:
    prompt = sum(u.prompt_tokens for u in usages)
    completion = sum(u.completion_tokens for u in usages)
    cached = sum(u.cached_tokens for u in usages)
    details = PromptTokensDetails(cached_tokens=cached) if cached else None
    return UsageInfo(prompt_tokens=prompt, completion_tokens=completion,
                     total_tokens=prompt + completion, prompt_tokens_details=details)  # fmt: skip


# -- rendering the core's events -----------------------------------------------------------


class Renderer(abc.ABC):
    """Turns generated text into one endpoint's bodies and stream chunks."""

    def __init__(self, request_id: str, model: str) -> None:
        self.request_id = request_id
        self.model = model
        self.created = int(time.time())

    def start(self, index: int) -> msgspec.Struct | None:
        return None

    @abc.abstractmethod
    def delta(self, index: int, text: str) -> msgspec.Struct: ...

    @abc.abstractmethod
    def finish(self, index: int, finish_reason: str) -> msgspec.Struct: ...

    @abc.abstractmethod
    def usage_chunk(self, usage: UsageInfo) -> msgspec.Struct: ...

    @abc.abstractmethod
    def body(self, texts: list[str], reasons: list[str], usage: UsageInfo) -> msgspec.Struct: ...


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
        choices = [CompletionChoice(index=i, text=text, finish_reason=reason)
                   for i, (text, reason) in enumerate(zip(texts, reasons, strict=True))]  # fmt: skip
        return self._chunk(choices, usage)


class ChatRenderer(Renderer):
    def _chunk(self, choices: list[ChatChunkChoice],
               usage: UsageInfo | None = None) -> ChatCompletionChunk:  # fmt: skip
        return ChatCompletionChunk(id=self.request_id, object="chat.completion.chunk",
                                   created=self.created, model=self.model, choices=choices,
                                   usage=usage)  # fmt: skip

    def start(self, index: int) -> ChatCompletionChunk:
        # OpenAI's first chunk names the role; clients key their message assembly on it.
        delta = Delta(role="assistant", content="")
        return self._chunk([ChatChunkChoice(index=index, delta=delta)])

    def delta(self, index: int, text: str) -> ChatCompletionChunk:
        return self._chunk([ChatChunkChoice(index=index, delta=Delta(content=text))])

    def finish(self, index: int, finish_reason: str) -> ChatCompletionChunk:
        choice = ChatChunkChoice(index=index, delta=Delta(), finish_reason=finish_reason)
        return self._chunk([choice])

    def usage_chunk(self, usage: UsageInfo) -> ChatCompletionChunk:
        return self._chunk([], usage)

    def body(self, texts: list[str], reasons: list[str], usage: UsageInfo) -> ChatCompletion:
        choices = [ChatChoice(index=i, message=ChatMessageOut(role="assistant", content=text),
                              finish_reason=reason)
                   for i, (text, reason) in enumerate(zip(texts, reasons, strict=True))]  # fmt: skip
        return ChatCompletion(id=self.request_id, object="chat.completion", created=self.created,
                              model=self.model, choices=choices, usage=usage)  # fmt: skip
