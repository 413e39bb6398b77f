"""OpenAI-compatible response bodies (completions, chat, their stream chunks, logprobs,
usage, models, errors) and the plain endpoints' answers (vLLM's /tokenize, /detokenize,
/version; /health), as msgspec Structs; openapi.py documents them."""

from __future__ import annotations

from typing import Any

import msgspec

from pdserve.common.runtime.protocol import Usage
from pdserve.services.router.tool_calls import DeltaToolCall, ToolCall

__all__ = [
    "PromptTokensDetails",
    "CompletionTokensDetails",
    "UsageInfo",
    "CompletionLogprobs",
    "PromptLogprob",
    "CompletionChoice",
    "TopLogprob",
    "ChatTokenLogprob",
    "ChatLogprobs",
    "Completion",
    "ChatMessageOut",
    "ChatChoice",
    "ChatCompletion",
    "Delta",
    "ChatChunkChoice",
    "ChatCompletionChunk",
    "ModelCard",
    "ModelList",
    "ErrorDetail",
    "ErrorBody",
    "TokenizeResponse",
    "DetokenizeResponse",
    "Version",
    "Health",
    "usage_of",
]


class PromptTokensDetails(msgspec.Struct, kw_only=True):
    cached_tokens: int = 0


class CompletionTokensDetails(msgspec.Struct, kw_only=True):
    reasoning_tokens: int = 0  # the thinking's, its markers included


class UsageInfo(msgspec.Struct, kw_only=True, omit_defaults=True):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None  # only when some were cached
    # only where a reasoning parser splits the answers
    completion_tokens_details: CompletionTokensDetails | None = None


class CompletionLogprobs(msgspec.Struct, kw_only=True):
    """OpenAI's legacy shape: per token its text, logprob, best alternatives (text ->
    logprob, the chosen token always among them) and offset in the choice's text."""

    tokens: list[str]
    token_logprobs: list[float | None]  # null for the first token of an echoed prompt
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class PromptLogprob(msgspec.Struct, kw_only=True):
    """vLLM's entry of ``prompt_logprobs``, keyed by token id (as a string)."""

    logprob: float
    rank: int | None  # 1: the most likely; null: the prompt's token, outside the top N
    decoded_token: str


class CompletionChoice(msgspec.Struct, kw_only=True):
    index: int
    text: str
    finish_reason: str | None  # stop | length | abort; null in a stream until the end
    logprobs: CompletionLogprobs | None = None
    # vLLM's prompt_logprobs: null for the first token, then the prompt token and top N
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = None


class TopLogprob(msgspec.Struct, kw_only=True):
    token: str
    logprob: float
    bytes: list[int] | None


class ChatTokenLogprob(msgspec.Struct, kw_only=True):
    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[TopLogprob]


class ChatLogprobs(msgspec.Struct, kw_only=True):
    content: list[ChatTokenLogprob] | None
    refusal: list[ChatTokenLogprob] | None = None


class Completion(msgspec.Struct, kw_only=True):
    id: str
    object: str  # text_completion
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None  # always set, except on stream chunks


class ChatMessageOut(msgspec.Struct, kw_only=True):
    role: str
    content: str | None  # null when the answer is only tool calls
    tool_calls: list[ToolCall] | None = None
    # A reasoning model's thinking (reasoning.py), under vLLM's name and DeepSeek's
    # (clients read one or the other): the same text; null without a reasoning parser.
    reasoning: str | None = None
    reasoning_content: str | None = None


class ChatChoice(msgspec.Struct, kw_only=True):
    index: int
    message: ChatMessageOut
    finish_reason: str
    logprobs: ChatLogprobs | None = None


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
    tool_calls: list[DeltaToolCall] | None = None
    reasoning: str | None = None  # the thinking, as in ChatMessageOut: both names
    reasoning_content: str | None = None


class ChatChunkChoice(msgspec.Struct, kw_only=True):
    index: int
    delta: Delta
    finish_reason: str | None = None
    logprobs: ChatLogprobs | None = None


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


class TokenizeResponse(msgspec.Struct, kw_only=True):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(msgspec.Struct, kw_only=True):
    prompt: str


class Version(msgspec.Struct, kw_only=True):
    version: str


class Health(msgspec.Struct, kw_only=True, omit_defaults=True):
    status: str  # ok | unavailable
    detail: dict[str, Any] | None = None


def usage_of(usages: list[Usage], n: int = 1, reasoning_tokens: int | None = None) -> UsageInfo:
    """``usages`` in choice order, ``n`` choices per prompt: a prompt counts once, as
    OpenAI counts it, however many choices it has. ``reasoning_tokens``: the thinking's
    of every choice (None: no reasoning parser, no details)."""
    prompt = sum(u.prompt_tokens for u in usages[::n])
    completion = sum(u.completion_tokens for u in usages)
    cached = sum(u.cached_tokens for u in usages[::n])
    details = PromptTokensDetails(cached_tokens=cached) if cached else None
    thinking = None
    if reasoning_tokens is not None:
        thinking = CompletionTokensDetails(reasoning_tokens=reasoning_tokens)
    return UsageInfo(prompt_tokens=prompt, completion_tokens=completion,
                     total_tokens=prompt + completion, prompt_tokens_details=details,
                     completion_tokens_details=thinking)  # fmt: skip
