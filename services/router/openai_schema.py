"""OpenAI-compatible request bodies, as msgspec Structs (responses: openai_responses.py;
field types and decoding: openai_types.py).

Requests are decoded straight into these types, so a wrong type or an out-of-range
value is a 400 whose message names the field (msgspec says "... - at `$.max_tokens`").
Unknown fields are ignored, as OpenAI and vLLM do: SDKs send fields like `user` or
`metadata` that change nothing here. Every field of OpenAI's and vLLM's requests that
changes the answer is declared: honoured, or refused by ``unsupported()`` with a 400
naming it (logprobs, tools, structured output, ...), never silently ignored, because
ignoring it would return a different answer from the one asked for. An explicit null
is the field's default (the openai SDK sends ``temperature=None`` as null).

openapi.py builds the OpenAPI document from these same types, so the schema that
fuzzers read cannot drift from what the server decodes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from pdserve.common.engine.sampling_params import SamplingParams, StructuredOutput

# Every response body too: importers of this module (``openai_schema as oa``) see them all.
from pdserve.services.router.openai_responses import *  # noqa: F403
from pdserve.services.router.openai_types import (
    Bias,
    Choices,
    Count,
    NonNegative,
    NullableAny,
    NumLogprobs,
    Penalty,
    Prompt,
    ReasoningEffort,
    ResponseFormat,
    Seed,
    StreamOptions,
    Temperature,
    Text,
    TokenId,
    only,
)
from pdserve.services.router.openai_types import decode_request as decode_request
from pdserve.services.router.structured_request import StructuredError, structured_of
from pdserve.services.router.tool_calls import (
    ToolError,
    ToolMode,
    check_calls,
    choice_of,
    constraint,
    functions_of,
)

NO_FUNCTIONS = "the legacy functions / function_call are not supported; use tools and tool_choice"
NO_PROMPT_LOGPROBS = (
    "the prompt's logprobs are given by completions (echo with logprobs, "
    "or prompt_logprobs), not by chat completions"
)

# Fields this server takes only at their default: (field, allowed values, why). Declared
# so that they are seen (an unknown field is ignored, as OpenAI does); null is always the
# default. Each is refused with a 400 naming it rather than silently ignored.
_Refusal = tuple[str, tuple[Any, ...], str]
Gate = Callable[[StructuredOutput | None], StructuredOutput | None]
_COMMON_REFUSALS: tuple[_Refusal, ...] = (
    ("use_beam_search", (None, False), "beam search is not supported"),
    ("bad_words", (None, []), "bad_words is not supported"),
    ("allowed_token_ids", (None,), "allowed_token_ids is not supported"),
    ("truncate_prompt_tokens", (None,), "truncate_prompt_tokens is not supported"),
    ("skip_special_tokens", (None, True), "skip_special_tokens=false is not supported"),
    ("spaces_between_special_tokens", (None, True),
     "spaces_between_special_tokens=false is not supported"),
)  # fmt: skip


class SamplingRequest(msgspec.Struct, kw_only=True):
    """Fields shared by completions and chat completions. null is the default everywhere."""

    model: str | None = None  # absent: the served model
    max_tokens: Count | None = None
    temperature: Temperature | None = None  # null: 1.0, OpenAI's default
    top_p: Annotated[float, Meta(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Meta(ge=-1)] | None = None  # extension (vLLM's); 0 or -1: off
    min_p: Annotated[float, Meta(ge=0.0, le=1.0)] | None = None  # extension (vLLM's)
    seed: Seed | None = None
    stop: Text | list[Text] | None = None
    stop_token_ids: list[TokenId] | None = None  # extension (vLLM's)
    ignore_eos: bool | None = None  # extension (vLLM's)
    include_stop_str_in_output: bool | None = None  # extension (vLLM's)
    min_tokens: NonNegative | None = None  # extension (vLLM's)
    n: Choices | None = None  # choices per prompt, each its own request (KV shared by prefix)
    best_of: Choices | None = None  # candidates per prompt; the n most likely are returned
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_penalty: Annotated[float, Meta(gt=0.0)] | None = None  # extension (vLLM's)
    logit_bias: dict[str, Bias] | None = None  # token id (as a string) -> bias
    # the caller's end user: names the client for fair admission when the deployment
    # sets trust_user_field (http_generate.py), else for the caller's records only
    user: Annotated[str, Meta(max_length=256)] | None = None
    # extension (vLLM's): lower is served first, at the router and in the engines (default 0)
    priority: Annotated[int, Meta(ge=-(2**31), lt=2**31)] | None = None
    response_format: ResponseFormat | None = None  # json_object / json_schema: constrained
    guided_json: Any = None  # vLLM's structured output (structured_request.py)
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None
    structured_outputs: dict[str, Any] | None = None
    prompt_logprobs: NumLogprobs | None = None  # vLLM's: completions only
    use_beam_search: NullableAny = None
    bad_words: NullableAny = None
    allowed_token_ids: NullableAny = None
    truncate_prompt_tokens: NullableAny = None
    skip_special_tokens: NullableAny = None
    spaces_between_special_tokens: NullableAny = None

    def _refused(self, refusals: tuple[_Refusal, ...]) -> tuple[str, str] | None:
        for name, allowed, why in refusals:
            value = getattr(self, name)
            if not any(value == a and type(value) is type(a) for a in allowed):
                return name, f"{name}: {why}"
        return None

    def _common_unsupported(self) -> tuple[str, str] | None:  # (param, message)
        if self.best_of is not None and self.best_of < self.num_choices:
            return "best_of", f"best_of ({self.best_of}) must be at least n ({self.num_choices})"
        if self.num_candidates > self.num_choices and self.is_stream:
            return "best_of", "best_of > n cannot stream: the best are known only at the end"
        if self.logit_bias:
            bad = next((k for k in self.logit_bias if not k.isdigit()), None)
            if bad is not None:
                return "logit_bias", f"logit_bias keys are token ids, got {bad!r}"
        try:
            structured_of(self)
        except StructuredError as exc:
            return exc.param, str(exc)
        return self._refused(_COMMON_REFUSALS)

    @property
    def num_choices(self) -> int:
        return self.n or 1

    @property
    def num_candidates(self) -> int:
        """Requests per prompt: best_of when it asks for more than n."""
        return max(self.best_of or 1, self.num_choices)

    @property
    def is_stream(self) -> bool:
        return bool(self.stream)

    def sampling(
        self, max_tokens: int, choice: int = 0, gate: Gate | None = None
    ) -> SamplingParams:
        """The engine's parameters for choice ``choice`` (of n): a seeded request gives
        each choice its own seed, so the n choices differ yet repeat run to run. ``gate``:
        where the constraint starts (a reasoning model's after its thinking)."""
        structured = self.constraint()
        if gate is not None:
            structured = gate(structured)
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        seed = None if self.seed is None else (self.seed + choice + 2**63) % 2**64 - 2**63
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_k=self.top_k or 0,
            top_p=1.0 if self.top_p is None else self.top_p,
            min_p=self.min_p or 0.0,
            seed=seed,
            stop=stop,
            stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=bool(self.ignore_eos),
            include_stop_str_in_output=bool(self.include_stop_str_in_output),
            min_tokens=self.min_tokens or 0,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            logit_bias={int(k): v for k, v in (self.logit_bias or {}).items()},
            # best_of ranks candidates by their tokens' summed logprobs
            logprobs=0
            if self.requested_logprobs is None and self.num_candidates > self.num_choices
            else self.requested_logprobs,
            structured=structured,
            prompt_logprobs=self.requested_prompt_logprobs,
        )

    @property
    def requested_prompt_logprobs(self) -> int | None:
        return None

    def constraint(self) -> StructuredOutput | None:
        """The grammar the output must follow (chat: a forced tool call's, tool_calls.py)."""
        return structured_of(self)

    @property
    def requested_logprobs(self) -> int | None:
        return None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and bool(self.stream_options.include_usage)


_COMPLETION_REFUSALS: tuple[_Refusal, ...] = (
    ("suffix", (None, ""), "suffix (insertion) is not supported"),
)


class CompletionRequest(SamplingRequest, kw_only=True):
    prompt: Prompt
    max_tokens: NonNegative | None = None  # 0: with echo, the prompt scored, nothing generated
    echo: bool | None = None  # the prompt's text before the completion
    logprobs: NumLogprobs | None = None  # each token's logprob and this many alternatives
    suffix: Annotated[str | None, only({"maxLength": 0})] = None

    def unsupported(self) -> tuple[str, str] | None:
        """(param, message) for the first field set to something this server cannot do."""
        if self.max_tokens == 0 and not self.echo:
            return (
                "max_tokens",
                "max_tokens 0 generates nothing; it needs echo (to score the prompt)",
            )
        return self._refused(_COMPLETION_REFUSALS) or self._common_unsupported()

    @property
    def is_scoring_only(self) -> bool:
        """max_tokens 0 with echo: one token is computed (prefill always samples one) and
        left out of the answer, as vLLM answers it."""
        return self.max_tokens == 0

    @property
    def requested_logprobs(self) -> int | None:
        return self.logprobs

    @property
    def requested_prompt_logprobs(self) -> int | None:
        """echo with logprobs N: the prompt's tokens get N alternatives as well (OpenAI's
        legacy shape); vLLM's prompt_logprobs asks on its own (and wins)."""
        if self.prompt_logprobs is not None:
            return self.prompt_logprobs
        return self.logprobs if self.echo else None


class ContentPart(msgspec.Struct, kw_only=True):
    type: str
    text: str | None = None


class ChatMessageIn(msgspec.Struct, kw_only=True):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's calls (OpenAI's shape)
    tool_call_id: str | None = None  # a tool message's answer to that call
    function_call: NullableAny = None
    # an assistant's thinking sent back (interleaved thinking): vLLM's name, DeepSeek's
    reasoning: str | None = None
    reasoning_content: str | None = None

    @property
    def thinking(self) -> str | None:
        return self.reasoning if self.reasoning is not None else self.reasoning_content


_CHAT_REFUSALS: tuple[_Refusal, ...] = (
    ("prompt_logprobs", (None,), NO_PROMPT_LOGPROBS),
    ("functions", (None, []), NO_FUNCTIONS),
    ("function_call", (None, "none"), NO_FUNCTIONS),
    ("documents", (None, []), "documents (RAG templates) are not supported"),
    ("chat_template", (None,), "a chat template in the request is not accepted; the model's "
     "own template renders the messages (chat_template_kwargs passes variables to it)"),
)  # fmt: skip


class ChatCompletionRequest(SamplingRequest, kw_only=True):
    messages: Annotated[list[ChatMessageIn], Meta(min_length=1)]
    max_completion_tokens: Count | None = None  # OpenAI's newer name; wins over max_tokens
    echo: bool | None = None  # vLLM's: a final assistant message's content starts the answer
    add_generation_prompt: bool | None = None  # null: true (vLLM's)
    continue_final_message: bool | None = None  # extend the final message (vLLM's)
    chat_template: str | None = None  # replaces the model's template (vLLM's)
    chat_template_kwargs: dict[str, Any] | None = None  # extra template variables (vLLM's)
    logprobs: bool | None = None  # each generated token's logprob
    top_logprobs: NumLogprobs | None = None  # and this many alternatives (needs logprobs)
    tools: list[Any] | None = None  # [{"type": "function", "function": {...}}] (tool_calls.py)
    tool_choice: Any = None  # none | auto | required | {"type": "function", "function": ...}
    parallel_tool_calls: bool | None = None  # false: at most one call
    functions: NullableAny = None
    function_call: NullableAny = None
    documents: NullableAny = None
    # a template variable, for the templates that read it (chat_prompts.py)
    reasoning_effort: ReasoningEffort | None = None

    def unsupported(self) -> tuple[str, str] | None:
        refused = self._refused(_CHAT_REFUSALS)
        if refused is not None:
            return refused
        thinking = reasoning_unsupported(self.messages)
        if thinking is not None:
            return thinking
        if self.top_logprobs is not None and not self.logprobs:
            return "top_logprobs", "top_logprobs needs logprobs set to true"
        if self.continue_final_message and self.add_generation_prompt:
            return "continue_final_message", ("continue_final_message and "
                                              "add_generation_prompt cannot both be true")  # fmt: skip
        for i, message in enumerate(self.messages):
            if message.role == "function" or message.function_call:
                return f"messages[{i}]", f"messages[{i}]: {NO_FUNCTIONS}"
            try:
                check_calls(message.tool_calls or [], f"messages[{i}]")
            except ToolError as exc:
                return exc.param, str(exc)
        try:
            tools = self.tool_mode
        except ToolError as exc:
            return exc.param, str(exc)
        if tools is not None and tools.forced is not None:
            if structured_of(self) is not None:
                return "tool_choice", (f"tool_choice {self.tool_choice!r} constrains the output; "
                                       "it cannot be combined with response_format or guided_*")  # fmt: skip
            if self.num_candidates > 1:
                return "tool_choice", "tool_choice 'required' or a named function takes n = 1"
        return self._common_unsupported()

    @property
    def tool_mode(self) -> ToolMode | None:
        """What the request's tools ask for (None: no tools); ToolError names a bad field."""
        functions = functions_of(self.tools or [])
        choice = choice_of(self.tool_choice, functions)
        if not functions:
            return None
        parallel = self.parallel_tool_calls is not False
        return ToolMode(choice=choice, functions=functions, parallel=parallel,
                        forced=constraint(choice, functions, parallel))  # fmt: skip

    def constraint(self) -> StructuredOutput | None:
        tools = self.tool_mode
        if tools is not None and tools.forced is not None:
            return tools.forced
        return structured_of(self)

    @property
    def requested_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    @property
    def wants_generation_prompt(self) -> bool:
        if self.add_generation_prompt is None:
            return not self.continue_final_message
        return self.add_generation_prompt


def reasoning_unsupported(messages: list[ChatMessageIn]) -> tuple[str, str] | None:
    """(param, message) for thinking sent back where it cannot go: on a message that is
    not the assistant's, or as two different texts under its two names."""
    for i, message in enumerate(messages):
        for name in ("reasoning", "reasoning_content"):
            if getattr(message, name) is not None and message.role != "assistant":
                return f"messages[{i}].{name}", (f"messages[{i}].{name}: only assistant "
                                                 "messages carry reasoning")  # fmt: skip
        if None not in (message.reasoning, message.reasoning_content) and \
                message.reasoning != message.reasoning_content:  # fmt: skip
            return f"messages[{i}].reasoning", (f"messages[{i}]: reasoning and "
                                                "reasoning_content differ; send one of them")  # fmt: skip
    return None


class TokenizeRequest(msgspec.Struct, kw_only=True):
    """vLLM's /tokenize: a prompt (completions) or messages (chat, rendered by the template)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessageIn] | None = None
    add_special_tokens: bool | None = None  # null: true for a prompt, false for messages
    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    # As chat completions render them, so the count is the one a chat completion sees.
    tools: list[Any] | None = None
    return_token_strs: bool | None = None


class DetokenizeRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    tokens: list[TokenId]
