"""OpenAI-compatible HTTP front end of the router (aiohttp).

The layer is thin: decode and check the body (openai_schema), tokenize (once, here, with
``core.tokenizer``), and hand the prompts to http_generate, which submits one ``Generate``
per candidate to the core and renders what the core yields as one JSON body or as
server-sent events. Request ids are described in core_api.

The HTTP status of an answer in one body is decided by the first event of every prompt:
an overloaded core becomes a 429, a dead peer a 503, a bad request a 400. A stream sends
its headers as soon as the core has admitted its requests (``submit`` raises a refusal:
429, 503, 400), before any token is computed, so a client waiting behind others knows it
is being served; a Failed after that can only be an SSE error event.

Tokenising holds the GIL: every body over LONG_TEXT_BYTES as read (a chunked body has no
Content-Length to go by) is tokenised in the tokenize pool's worker process, under its
deadline (504 past it). A body not read whole within ``body_read_timeout_seconds`` gets
a 408 and its connection closed (http_errors.read_body).

A client that goes away must not leave its request running. The app sets aiohttp's
``handler_cancellation`` (through ``handler_args``, so it holds whoever runs the app):
the handler task is cancelled on disconnect, which closes the core's iterators, which
aborts the requests. A failed SSE write does the same.
"""

from __future__ import annotations

import asyncio
import functools
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import msgspec
import structlog
from aiohttp import web

from pdserve.common.engine.sampling_params import StructuredOutput
from pdserve.services.router import openai_schema as oa
from pdserve.services.router.chat_prompts import (
    chat_prompt,
    chat_prompt_and_tail,
    completion_echoes,
    completion_prompts,
    content_text,
    detokenize_answer,
    tokenize_answer,
)
from pdserve.services.router.core_api import Refused, RouterCore
from pdserve.services.router.cors import Cors
from pdserve.services.router.http_errors import (
    BODY_TIMEOUT_KEY,
    DEFAULT_BODY_TIMEOUT,
    ECHO_ID,
    MAX_BODY_KEY,
    OPEN_PATHS,
    ApiError,
    decode_body,
    error_middleware,
    json_response,
    key_middleware,
    read_body,
    sane_header,
)
from pdserve.services.router.http_generate import generate
from pdserve.services.router.input_limits import num_prompts, text_chars
from pdserve.services.router.openapi import openapi
from pdserve.services.router.reasoning import ReasoningParser, Start, ThinkingSplit, parser_of
from pdserve.services.router.renderers import ChatRenderer, CompletionRenderer
from pdserve.services.router.tokenize_pool import TokenizePool
from pdserve.services.router.tool_calls import detect_parser

__all__ = ["OPEN_PATHS", "ApiError", "OpenAIApi", "make_app"]

log = structlog.get_logger("pdserve.router.http")

MAX_BODY_BYTES = 32 * 2**20  # a 1M-token prompt as JSON ints is ~7 MB
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
LONG_TEXT_BYTES = 16_384  # tokenize longer bodies (or texts) off the event loop
PROMETHEUS_TEXT = "text/plain; version=0.0.4; charset=utf-8"

T = TypeVar("T")


class OpenAIApi:
    def __init__(self, core: RouterCore, served_model_names: Sequence[str] = (),
                 tool_call_parser: str = "auto", pool: TokenizePool | None = None,
                 max_prompts: int = 128, reasoning_parser: str = "auto",
                 special_tokens_in_content: bool = True) -> None:  # fmt: skip
        """``served_model_names``: the ids clients may name (the first is the one answers
        carry when a request names none); empty: the core's model name alone.
        ``tool_call_parser``: llama3_json, hermes, or auto (read off the chat template).
        ``pool``: where long texts are tokenised (else a thread); ``max_prompts``: per
        request. ``reasoning_parser``: how chat answers' thinking is split off
        (reasoning.py: a name, auto or none); PdserveError when it cannot be.
        ``special_tokens_in_content``: False, a special token's text in a message's
        content is tokenised as plain text (chat_prompts.chat_prompt)."""
        self.core = core
        self.special_tokens_in_content = special_tokens_in_content
        self.tool_call_parser = tool_call_parser
        self.reasoning = parser_of(reasoning_parser, core.tokenizer)
        log.info("reasoning_parser", requested=reasoning_parser,
                 used=self.reasoning.name if self.reasoning else "none")  # fmt: skip
        self.pool = pool
        self.max_prompts = max_prompts
        # A text longer than this cannot fit max_model_len: refused before tokenising.
        self.max_chars = core.max_model_len * core.tokenizer.longest_token_chars
        self.model_names = list(served_model_names) or [core.model_name]
        self.created = int(time.time())
        self._in_flight: set[str] = set()  # HTTP request ids now running, to keep them unique

    # -- plain endpoints ------------------------------------------------------------------

    def _card(self, name: str) -> oa.ModelCard:
        return oa.ModelCard(id=name, object="model", created=self.created,
                            owned_by="pdserve", max_model_len=self.core.max_model_len)  # fmt: skip

    def served_name(self, requested: str | None, param: str | None = "model") -> str:
        """The id an answer carries: the requested one when served, else a 404."""
        if requested is None:
            return self.model_names[0]
        if requested not in self.model_names:
            served = ", ".join(repr(n) for n in self.model_names)
            raise ApiError(404, f"the model {requested!r} does not exist here; this server "
                           f"serves {served} (see /v1/models)", param=param,
                           code="model_not_found")  # fmt: skip
        return requested

    async def models(self, request: web.Request) -> web.Response:
        return json_response(
            oa.ModelList(object="list", data=[self._card(n) for n in self.model_names])
        )

    async def model(self, request: web.Request) -> web.Response:
        return json_response(self._card(self.served_name(request.match_info["model"], None)))

    async def tokenize(self, request: web.Request) -> web.Response:
        req = await decode_body(request, oa.TokenizeRequest)
        self.served_name(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise ApiError(400, "give exactly one of prompt or messages", param="prompt",
                           code="invalid_value")  # fmt: skip
        answer = functools.partial(tokenize_answer,
                                   special_in_content=self.special_tokens_in_content)  # fmt: skip
        ids, strs = await self._tokenize(request, answer, req)
        return json_response(oa.TokenizeResponse(count=len(ids), max_model_len=self.core.max_model_len,
                                         tokens=ids, token_strs=strs if req.return_token_strs
                                         else None))  # fmt: skip

    async def detokenize(self, request: web.Request) -> web.Response:
        req = await decode_body(request, oa.DetokenizeRequest)
        self.served_name(req.model)
        vocab = self.core.tokenizer.vocab_size
        bad = next((t for t in req.tokens if t >= vocab), None)
        if bad is not None:
            raise ApiError(400, f"token id {bad} is outside the vocabulary (0..{vocab - 1})",
                           param="tokens", code="invalid_value")  # fmt: skip
        text = await self._tokenize(request, detokenize_answer, req.tokens)
        return json_response(oa.DetokenizeResponse(prompt=text))

    async def version(self, request: web.Request) -> web.Response:
        return json_response(oa.Version(version=_package_version()))

    async def health(self, request: web.Request) -> web.Response:
        if self.core.is_ready():
            return json_response(oa.Health(status="ok"))
        return json_response(oa.Health(status="unavailable", detail=self.core.health_detail()), 503)

    async def metrics(self, request: web.Request) -> web.Response:
        body = await self.core.metrics_text()
        return web.Response(body=body, headers={"Content-Type": PROMETHEUS_TEXT})

    # -- generation -----------------------------------------------------------------------

    async def completions(self, request: web.Request) -> web.StreamResponse:
        req = await decode_body(request, oa.CompletionRequest)
        model = self._check(req, req.unsupported())
        if num_prompts(req.prompt) > self.max_prompts:
            raise ApiError(400, f"prompt holds {num_prompts(req.prompt)} prompts, more than "
                           f"{self.max_prompts} (max_prompts_per_request); split the batch",
                           param="prompt", code="too_many_prompts")  # fmt: skip
        prompts = await self._tokenize(request, completion_prompts, req.prompt)
        echoes = completion_echoes(self.core, req.prompt, prompts) if req.echo else None
        request_id = self._request_id(request, "cmpl")
        renderer = CompletionRenderer(request_id, model, self._token_text)
        max_tokens = 1 if req.is_scoring_only else req.max_tokens
        return await generate(self.core, request, req, prompts, renderer, self._in_flight,
                              default_max_tokens=COMPLETIONS_DEFAULT_MAX_TOKENS,
                              requested_max_tokens=max_tokens, echoes=echoes,
                              scoring_only=req.is_scoring_only)  # fmt: skip

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        req = await decode_body(request, oa.ChatCompletionRequest)
        model = self._check(req, req.unsupported())
        thinking: Callable[[], ThinkingSplit] | None = None
        gate: oa.Gate | None = None
        special = self.special_tokens_in_content
        if self.reasoning is None:
            render = functools.partial(chat_prompt, special_in_content=special)
            prompt = await self._tokenize(request, render, req)
        else:
            render_tail = functools.partial(chat_prompt_and_tail, special_in_content=special)
            prompt, tail = await self._tokenize(request, render_tail, req)
            thinking, gate = self._thinking(self.reasoning, self.reasoning.start(prompt, tail))
        echoes = None
        if req.echo:  # vLLM's: a final assistant message is the start of the answer
            last = req.messages[-1]
            echoes = [content_text(last.content) if last.role == "assistant" else ""]
        request_id = self._request_id(request, "chatcmpl")
        parser = self.tool_call_parser
        if parser == "auto":
            parser = detect_parser(self.core.tokenizer.chat_template)
        renderer = ChatRenderer(request_id, model, self._token_text, req.tool_mode, parser,
                                thinking)  # fmt: skip
        return await generate(self.core, request, req, [prompt], renderer, self._in_flight,
                              requested_max_tokens=req.requested_max_tokens, echoes=echoes,
                              gate=gate)  # fmt: skip

    def _thinking(self, parser: ReasoningParser,
                  start: Start) -> tuple[Callable[[], ThinkingSplit], oa.Gate]:  # fmt: skip
        """A choice's splitter, and its constraint's gate: after the thinking."""
        decode = self.core.tokenizer.decode

        def split() -> ThinkingSplit:
            return ThinkingSplit(parser, start, decode)

        def gate(structured: StructuredOutput | None) -> StructuredOutput | None:
            return parser.gate(structured, start)

        return split, gate

    def _token_text(self, token_id: int) -> str:
        return self.core.tokenizer.decode([token_id], skip_special_tokens=False)

    def _check(self, req: oa.SamplingRequest, unsupported: tuple[str, str] | None) -> str:
        """The model id the answer carries, once the request is one this server can do."""
        model = self.served_name(req.model)
        if unsupported is not None:
            raise ApiError(400, unsupported[1], param=unsupported[0], code="unsupported_parameter")
        return model

    async def _tokenize(self, request: web.Request, fn: Callable[[RouterCore, Any], T],
                        arg: Any) -> T:  # fmt: skip
        chars = text_chars(arg)
        if chars > self.max_chars:  # it cannot fit: not worth tokenising
            raise ApiError(400, f"the prompt has {chars} characters: more than max_model_len "
                           f"{self.core.max_model_len} tokens can hold (at most "
                           f"{self.max_chars}); shorten it", code="prompt_too_long")  # fmt: skip
        # Tokenizing a long prompt holds the GIL: in a worker process, the loop stays free.
        # By the body as read, whatever its framing, and by the text (a template may add).
        if max(chars, len(await read_body(request))) <= LONG_TEXT_BYTES:
            return fn(self.core, arg)
        if self.pool is None:
            return await asyncio.to_thread(fn, self.core, arg)
        try:
            return await self.pool.run(fn, arg)
        except Refused as exc:  # its deadline (504) or its queue's bound (429)
            raise ApiError.of_reason(exc.reason, str(exc)) from None

    def _request_id(self, request: web.Request, prefix: str) -> str:
        header = sane_header(request)
        request_id = f"{prefix}-{header or uuid.uuid4().hex}"
        if request_id in self._in_flight:
            request_id = f"{request_id}-{uuid.uuid4().hex[:8]}"
        ECHO_ID.set(header or request_id)
        return request_id


def _package_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("pdserve")
    except PackageNotFoundError:  # a source tree that was never installed
        return "0+unknown"


def make_app(core: RouterCore, *, served_model_names: Sequence[str] = (),
             api_key: str | Sequence[str] = "",
             allowed_origins: Sequence[str] = (), tool_call_parser: str = "auto",
             reasoning_parser: str = "auto",
             pool: TokenizePool | None = None, max_prompts: int = 128,
             max_body_bytes: int = MAX_BODY_BYTES,
             body_read_timeout: float = DEFAULT_BODY_TIMEOUT,
             special_tokens_in_content: bool = True) -> web.Application:  # fmt: skip
    """``served_model_names``: the model ids clients may use (empty: the core's);
    ``api_key``: when set (one key, or several), every route but OPEN_PATHS wants
    ``Authorization: Bearer`` with one of them;
    ``allowed_origins``: browser origins CORS lets in ("*": any; empty: CORS off);
    ``reasoning_parser``: how chat answers' thinking is split off (reasoning.py);
    ``body_read_timeout``: seconds to receive a whole body (408 past it);
    ``special_tokens_in_content``: False, special-token text in message content is text."""
    middlewares: list[Any] = [error_middleware]
    keys = [api_key] if isinstance(api_key, str) else list(api_key)
    if any(keys):
        middlewares.append(key_middleware([k for k in keys if k]))
    app = web.Application(
        middlewares=middlewares,
        client_max_size=max_body_bytes,
        handler_args={"handler_cancellation": True},  # disconnect -> cancel -> abort
    )
    if allowed_origins:
        Cors(allowed_origins).install(app)
    app[MAX_BODY_KEY] = max_body_bytes
    app[BODY_TIMEOUT_KEY] = body_read_timeout
    api = OpenAIApi(core, served_model_names, tool_call_parser, pool, max_prompts,
                    reasoning_parser, special_tokens_in_content)  # fmt: skip
    # The checked-in openapi.json is the generic document; this one names the model.
    document = openapi(api.model_names, core.max_model_len, core.tokenizer.vocab_size)
    document_body = msgspec.json.encode(document)

    async def openapi_json(request: web.Request) -> web.Response:
        return web.Response(body=document_body, content_type="application/json")

    app.router.add_get("/v1/models", api.models)
    app.router.add_get("/v1/models/{model}", api.model)
    app.router.add_post("/v1/completions", api.completions)
    app.router.add_post("/v1/chat/completions", api.chat_completions)
    app.router.add_post("/tokenize", api.tokenize)
    app.router.add_post("/detokenize", api.detokenize)
    app.router.add_get("/version", api.version)
    app.router.add_get("/health", api.health)
    app.router.add_get("/metrics", api.metrics)
    app.router.add_get("/openapi.json", openapi_json)
    return app
