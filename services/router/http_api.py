"""OpenAI-compatible HTTP front end of the router (aiohttp).

The layer is thin: decode and check the body (openai_schema), tokenize (once, here, with
``core.tokenizer``), submit one ``Generate`` per prompt to the core, and render what the
core yields as one JSON body or as server-sent events. Request ids are described in
core_api.

The HTTP status is decided by the first event of every prompt, so the handler waits for
it before sending headers: an overloaded core (Failed "overloaded" before any token)
becomes a 429, a dead peer a 503, a bad request a 400, and a stream only starts once it
has something to say. A Failed after that can only be an SSE error event.

A client that goes away must not leave its request running. The app sets aiohttp's
``handler_cancellation`` (through ``handler_args``, so it holds whoever runs the app):
the handler task is cancelled on disconnect, which closes the core's iterators, which
aborts the requests. A failed SSE write does the same.
"""

from __future__ import annotations

import asyncio
import hmac
import re
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import suppress
from contextvars import ContextVar
from typing import Any, TypeVar

import msgspec
import structlog
from aiohttp import web

from pdserve.common.engine.sampling_params import TokenLogprobs
from pdserve.common.errors import PdserveError, RequestError
from pdserve.common.runtime.protocol import Failed, Finished, Generate, TokenChunk
from pdserve.services.router import openai_schema as oa
from pdserve.services.router.core_api import Batch, Event, RouterCore
from pdserve.services.router.cors import Cors
from pdserve.services.router.input_limits import num_prompts, text_chars
from pdserve.services.router.openapi import openapi
from pdserve.services.router.renderers import (
    ChatRenderer,
    CompletionRenderer,
    PromptScored,
    Renderer,
)
from pdserve.services.router.tokenize_pool import TokenizePool
from pdserve.services.router.tool_calls import (
    ToolError,
    detect_parser,
    functions_of,
    template_messages,
)

log = structlog.get_logger("pdserve.router.http")

MAX_BODY_BYTES = 32 * 2**20  # a 1M-token prompt as JSON ints is ~7 MB
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
MAX_BODY_KEY = web.AppKey("max_body_bytes", int)
LONG_TEXT_BYTES = 16_384  # tokenize longer bodies off the event loop
PROMETHEUS_TEXT = "text/plain; version=0.0.4; charset=utf-8"
_SANE_ID = re.compile(r"[\x21-\x7e]{1,128}")  # printable ASCII, no spaces
_FIELD = re.compile(r"at `\$\.?([^`]*)`")
_FAILED_STATUS = {
    "bad_request": 400,
    "overloaded": 429,
    "peer_down": 503,
    "draining": 503,
    "timeout": 504,
}
_ERROR_TYPES = {400: "invalid_request_error", 401: "invalid_request_error",
                404: "not_found_error", 405: "invalid_request_error",
                413: "invalid_request_error", 429: "overloaded_error",
                503: "service_unavailable_error"}  # fmt: skip
# The id to echo in x-request-id: set by a generation handler, read by the middleware (same
# task, so the same context).
_ECHO_ID: ContextVar[str | None] = ContextVar("pdserve_http_request_id", default=None)
_RETRY_LATER = {429, 503}  # statuses worth a retry: tell SDKs when (they honour Retry-After)
OPEN_PATHS = frozenset({"/health", "/metrics"})  # no API key needed: probes and scrapers

T = TypeVar("T")
# a choice's index and its prompt's logprobs -> how to show them
ScoredPrompt = Callable[[int, list[TokenLogprobs]], PromptScored]
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class ApiError(Exception):
    """An error answer: status plus OpenAI's error body."""

    def __init__(
        self, status: int, message: str, *, param: str | None = None, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.args = (status, message, param, code)  # pickles (the tokenize pool raises it)
        self.status = status
        self.detail = oa.ErrorDetail(
            message=message,
            type=_ERROR_TYPES.get(status, "server_error"),
            param=param,
            code=code,
        )

    def __reduce__(self) -> tuple[Any, ...]:
        status, message, param, code = self.args
        return (_api_error, (status, message, param, code))

    @classmethod
    def from_failed(cls, failed: Failed) -> ApiError:
        status = _FAILED_STATUS.get(failed.reason, 500)
        return cls(status, f"request {failed.request_id}: {failed.message}", code=failed.reason)

    def response(self) -> web.Response:
        headers = {"Retry-After": "1"} if self.status in _RETRY_LATER else None
        return _json(oa.ErrorBody(error=self.detail), status=self.status, headers=headers)


def _api_error(status: int, message: str, param: str | None, code: str | None) -> ApiError:
    return ApiError(status, message, param=param, code=code)


def _json(body: msgspec.Struct, status: int = 200,
          headers: dict[str, str] | None = None) -> web.Response:  # fmt: skip
    body_bytes = msgspec.json.encode(body)
    return web.Response(body=body_bytes, status=status, content_type="application/json",
                        headers=headers)  # fmt: skip


@web.middleware
async def _error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every error leaves as OpenAI's error body; a bug is a 500 naming the request, and
    its traceback goes to the log, never to the client."""
    _ECHO_ID.set(None)  # keep-alive requests share the connection's task
    try:
        response = await handler(request)
    except ApiError as exc:
        response = exc.response()
    except RequestError as exc:
        response = ApiError(400, str(exc), code="bad_request").response()
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        response = _http_error(request, exc).response()
        if "Allow" in exc.headers:
            response.headers["Allow"] = exc.headers["Allow"]
    except Exception:
        failed_id = _ECHO_ID.get() or "-"
        log.exception("http_internal_error", request_id=failed_id, path=request.path)
        response = ApiError(
            500, f"internal error in request {failed_id}; the router's log has details",
            code="internal",
        ).response()  # fmt: skip
    echo_id = _ECHO_ID.get() or _sane_header(request)
    if echo_id is not None and not response.prepared:
        response.headers["x-request-id"] = echo_id
    return response


def _key_middleware(
    api_key: str,
) -> Callable[[web.Request, Handler], Awaitable[web.StreamResponse]]:
    """OpenAI's scheme: ``Authorization: Bearer <key>`` on every route but OPEN_PATHS."""
    expected = api_key.encode()

    @web.middleware
    async def check_key(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path not in OPEN_PATHS:
            scheme, _, given = request.headers.get("Authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(),
                                                                     expected):  # fmt: skip
                what = "no API key" if not given else "an incorrect API key"
                raise ApiError(401, f"{what} was provided; send the server's key as "
                               "'Authorization: Bearer KEY'", code="invalid_api_key")  # fmt: skip
        return await handler(request)

    return check_key


def _http_error(request: web.Request, exc: web.HTTPException) -> ApiError:
    if isinstance(exc, web.HTTPMethodNotAllowed):
        allowed = ", ".join(sorted(exc.allowed_methods))
        message = f"{request.method} is not allowed on {request.path}; use {allowed}"
        return ApiError(405, message, code="method_not_allowed")
    if exc.status == 404:
        message = f"no such route: {request.method} {request.path} (see /openapi.json)"
        return ApiError(404, message, code="not_found")
    if exc.status == 413:
        message = f"the request body is over {request.app[MAX_BODY_KEY]} bytes"
        return ApiError(413, message, code="body_too_large")
    return ApiError(exc.status, exc.reason, code=exc.reason.lower().replace(" ", "_"))


def _sane_header(request: web.Request) -> str | None:
    value = request.headers.get("x-request-id")
    return value if value is not None and _SANE_ID.fullmatch(value) else None


async def _decode(request: web.Request, kind: type[T]) -> T:
    body = await request.read()
    try:
        return oa.decode_request(body, kind)
    except msgspec.ValidationError as exc:
        field = _FIELD.search(str(exc))
        raise ApiError(400, f"invalid request: {exc}", param=field and field.group(1),
                       code="invalid_value") from None  # fmt: skip
    except msgspec.DecodeError as exc:
        raise ApiError(400, f"the body is not valid JSON: {exc}", code="invalid_json") from None


class OpenAIApi:
    def __init__(self, core: RouterCore, served_model_names: Sequence[str] = (),
                 tool_call_parser: str = "auto", pool: TokenizePool | None = None,
                 max_prompts: int = 128) -> None:  # fmt: skip
        """``served_model_names``: the ids clients may name (the first is the one answers
        carry when a request names none); empty: the core's model name alone.
        ``tool_call_parser``: llama3_json, hermes, or auto (read off the chat template).
        ``pool``: where long texts are tokenised (else a thread); ``max_prompts``: per
        request."""
        self.core = core
        self.tool_call_parser = tool_call_parser
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
        return _json(oa.ModelList(object="list", data=[self._card(n) for n in self.model_names]))

    async def model(self, request: web.Request) -> web.Response:
        return _json(self._card(self.served_name(request.match_info["model"], None)))

    async def tokenize(self, request: web.Request) -> web.Response:
        req = await _decode(request, oa.TokenizeRequest)
        self.served_name(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise ApiError(400, "give exactly one of prompt or messages", param="prompt",
                           code="invalid_value")  # fmt: skip
        tokenizer = self.core.tokenizer
        if req.prompt is not None and req.tools:
            raise ApiError(400, "tools are rendered by the chat template; give messages, not a "
                           "prompt", param="tools", code="invalid_value")  # fmt: skip
        if req.prompt is not None:
            add_special = True if req.add_special_tokens is None else req.add_special_tokens
            ids = tokenizer.encode(req.prompt, add_special_tokens=add_special)
        else:
            try:
                functions_of(req.tools or [])
            except ToolError as exc:
                raise ApiError(400, str(exc), param=exc.param, code="invalid_value") from None
            chat = oa.ChatCompletionRequest(
                messages=req.messages or [], add_generation_prompt=req.add_generation_prompt,
                continue_final_message=req.continue_final_message,
                chat_template_kwargs=req.chat_template_kwargs, tools=req.tools,
            )  # fmt: skip
            ids = await self._tokenize(request, _chat_prompt, chat)
            if req.add_special_tokens and tokenizer.bos_token_id is not None:
                ids = [tokenizer.bos_token_id, *ids]
        strs = [tokenizer.decode([t], skip_special_tokens=False) for t in ids]
        return _json(oa.TokenizeResponse(count=len(ids), max_model_len=self.core.max_model_len,
                                         tokens=ids, token_strs=strs if req.return_token_strs
                                         else None))  # fmt: skip

    async def detokenize(self, request: web.Request) -> web.Response:
        req = await _decode(request, oa.DetokenizeRequest)
        self.served_name(req.model)
        vocab = self.core.tokenizer.vocab_size
        bad = next((t for t in req.tokens if t >= vocab), None)
        if bad is not None:
            raise ApiError(400, f"token id {bad} is outside the vocabulary (0..{vocab - 1})",
                           param="tokens", code="invalid_value")  # fmt: skip
        return _json(oa.DetokenizeResponse(prompt=self.core.tokenizer.decode(req.tokens)))

    async def version(self, request: web.Request) -> web.Response:
        return _json(oa.Version(version=_package_version()))

    async def health(self, request: web.Request) -> web.Response:
        if self.core.is_ready():
            return _json(oa.Health(status="ok"))
        return _json(oa.Health(status="unavailable", detail=self.core.health_detail()), 503)

    async def metrics(self, request: web.Request) -> web.Response:
        body = await self.core.metrics_text()
        return web.Response(body=body, headers={"Content-Type": PROMETHEUS_TEXT})

    # -- generation -----------------------------------------------------------------------

    async def completions(self, request: web.Request) -> web.StreamResponse:
        req = await _decode(request, oa.CompletionRequest)
        model = self._check(req, req.unsupported())
        if num_prompts(req.prompt) > self.max_prompts:
            raise ApiError(400, f"prompt holds {num_prompts(req.prompt)} prompts, more than "
                           f"{self.max_prompts} (max_prompts_per_request); split the batch",
                           param="prompt", code="too_many_prompts")  # fmt: skip
        prompts = await self._tokenize(request, _completion_prompts, req.prompt)
        echoes = _completion_echoes(self.core, req.prompt, prompts) if req.echo else None
        request_id = self._request_id(request, "cmpl")
        renderer = CompletionRenderer(request_id, model, self._token_text)
        max_tokens = 1 if req.is_scoring_only else req.max_tokens
        return await self._generate(request, req, prompts, COMPLETIONS_DEFAULT_MAX_TOKENS,
                                    max_tokens, renderer, echoes, req.is_scoring_only)  # fmt: skip

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        req = await _decode(request, oa.ChatCompletionRequest)
        model = self._check(req, req.unsupported())
        prompt = await self._tokenize(request, _chat_prompt, req)
        echoes = None
        if req.echo:  # vLLM's: a final assistant message is the start of the answer
            last = req.messages[-1]
            echoes = [_content_text(last.content) if last.role == "assistant" else ""]
        request_id = self._request_id(request, "chatcmpl")
        parser = self.tool_call_parser
        if parser == "auto":
            parser = detect_parser(self.core.tokenizer.chat_template)
        renderer = ChatRenderer(request_id, model, self._token_text, req.tool_mode, parser)
        return await self._generate(request, req, [prompt], None, req.requested_max_tokens,
                                    renderer, echoes)  # fmt: skip

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
        if (request.content_length or 0) > LONG_TEXT_BYTES:
            if self.pool is not None:
                return await self.pool.run(fn, arg)
            return await asyncio.to_thread(fn, self.core, arg)
        return fn(self.core, arg)

    def _request_id(self, request: web.Request, prefix: str) -> str:
        header = _sane_header(request)
        request_id = f"{prefix}-{header or uuid.uuid4().hex}"
        if request_id in self._in_flight:
            request_id = f"{request_id}-{uuid.uuid4().hex[:8]}"
        _ECHO_ID.set(header or request_id)
        return request_id

    def _max_tokens(self, prompt: list[int], prompt_param: str, default: int | None,
                    requested: int | None) -> int:  # fmt: skip
        limit = self.core.max_model_len
        room = limit - len(prompt)
        if room < 1:
            raise ApiError(400, f"the prompt is {len(prompt)} tokens; this model takes at most "
                           f"{limit - 1} (max_model_len {limit} counts the generated tokens too)",
                           param=prompt_param, code="context_length_exceeded")  # fmt: skip
        if requested is None:
            return min(default or room, room)
        if requested > room:
            raise ApiError(400, f"max_tokens {requested} plus the prompt's {len(prompt)} tokens "
                           f"exceeds max_model_len {limit}; ask for at most {room}",
                           param="max_tokens", code="context_length_exceeded")  # fmt: skip
        return requested

    async def _generate(
        self,
        request: web.Request,
        req: oa.SamplingRequest,
        prompts: list[list[int]],
        default_max_tokens: int | None,
        requested_max_tokens: int | None,
        renderer: Renderer,
        echoes: list[str] | None = None,
        scoring_only: bool = False,
    ) -> web.StreamResponse:
        """``scoring_only``: the generated token is left out of the answer (max_tokens 0).
        One Generate per candidate: best_of (else n) per prompt, index = prompt index x
        n + j (the n requests share the prompt's KV blocks through the prefix cache)."""
        n = req.num_candidates
        num_choices = len(prompts) * n
        ids = [renderer.request_id] if num_choices == 1 else [
            f"{renderer.request_id}-{i}" for i in range(num_choices)
        ]  # fmt: skip
        gens = []
        prompt_param = "messages" if isinstance(renderer, ChatRenderer) else "prompt"
        vocab = self.core.tokenizer.vocab_size
        for index, request_id in enumerate(ids):
            prompt = prompts[index // n]
            max_tokens = self._max_tokens(prompt, prompt_param, default_max_tokens,
                                          requested_max_tokens)  # fmt: skip
            sampling = req.sampling(max_tokens, index % n)
            sampling.validate(vocab)  # the core checks again; failing here names no peer
            gens.append(Generate(request_id=request_id, prompt_token_ids=prompt,
                                 sampling=sampling, stream=req.is_stream))  # fmt: skip
        choice_echoes = None if echoes is None else [echoes[i // n] for i in range(num_choices)]
        scored: ScoredPrompt | None = None
        if req.requested_prompt_logprobs is not None:
            show_echo = bool(getattr(req, "echo", False)) and req.requested_logprobs is not None
            show_field = getattr(req, "prompt_logprobs", None) is not None

            def scored(index: int, lps: list[TokenLogprobs]) -> PromptScored:
                return PromptScored(token_ids=prompts[index // n], logprobs=lps,
                                    echo=show_echo, vllm_field=show_field)  # fmt: skip

        batch = _ScoringOnly() if scoring_only else Batch()
        owner = f"http:{request.remote}"  # its share of the router's slots (fair admission)
        self._in_flight.update(ids)
        try:
            # The first candidate of each prompt first: once it has a token, its prompt's
            # blocks are in the prefix cache, and the other n - 1 (sent to the same prefill
            # by prefix affinity) reuse them instead of computing the prompt again.
            stages = [range(0, num_choices, n)] + ([] if n == 1 else [
                [i for i in range(num_choices) if i % n]
            ])  # fmt: skip
            for stage in stages:
                for index in stage:
                    batch.add(self.core.submit(gens[index], owner=owner), index)
                for event in await batch.first_events():
                    if isinstance(event, Failed):
                        raise ApiError.from_failed(event)
            if req.is_stream:
                return await self._stream(request, batch, renderer, req.include_usage,
                                          num_choices, n, choice_echoes, scored)  # fmt: skip
            return await self._collect(batch, renderer, num_choices, n, choice_echoes,
                                       req.num_choices, req.requested_logprobs is not None,
                                       scored)  # fmt: skip
        finally:
            await batch.close()
            self._in_flight.difference_update(ids)

    async def _collect(self, batch: Batch, renderer: Renderer, num_choices: int, n: int,
                       echoes: list[str] | None, keep: int, show_logprobs: bool,
                       scored: ScoredPrompt | None = None) -> web.Response:  # fmt: skip
        """``n`` candidates per prompt, of which the ``keep`` most likely are answered."""
        texts: list[list[str]] = (
            [[e] for e in echoes] if echoes else [[] for _ in range(num_choices)]
        )
        logprobs: list[list[TokenLogprobs]] = [[] for _ in range(num_choices)]
        prompts: list[PromptScored | None] = [None] * num_choices
        finished: list[Finished | None] = [None] * num_choices
        async for index, event in batch.events():
            if isinstance(event, TokenChunk):
                texts[index].append(event.text)
                logprobs[index] += event.logprobs
                if scored is not None and event.prompt_logprobs is not None:
                    prompts[index] = scored(index, event.prompt_logprobs)
            elif isinstance(event, Finished):
                finished[index] = event
            else:
                raise ApiError.from_failed(event)
        done = [f for f in finished if f is not None]
        usage = oa.usage_of([f.usage for f in done], n)  # every candidate was generated
        chosen = list(range(len(done)))
        if keep < n:  # best_of: per prompt, the candidates with the highest summed logprob
            chosen = [i for start in range(0, len(done), n) for i in sorted(
                range(start, start + n), key=lambda i: -sum(lp.logprob for lp in logprobs[i])
            )[:keep]]  # fmt: skip
        body = renderer.body(
            ["".join(texts[i]) for i in chosen],
            [done[i].finish_reason for i in chosen],
            usage,
            [logprobs[i] if show_logprobs else [] for i in chosen],
            [echoes[i] for i in chosen] if echoes else [],
            [prompts[i] for i in chosen],
        )
        return _json(body)

    async def _stream(
        self, request: web.Request, batch: Batch, renderer: Renderer, include_usage: bool,
        num_choices: int, n: int, echoes: list[str] | None, scored: ScoredPrompt | None = None,
    ) -> web.StreamResponse:  # fmt: skip
        response = web.StreamResponse(headers={
            "Content-Type": "text/event-stream", "Cache-Control": "no-cache",
            "X-Accel-Buffering": "no",  # proxies must not hold back events
            "x-request-id": _ECHO_ID.get() or renderer.request_id,
        })  # fmt: skip
        await response.prepare(request)
        done: list[Finished | None] = [None] * num_choices
        try:
            for index in range(num_choices):
                await _send(response, renderer.start(index))
                # with prompt logprobs the echo waits for them (they come with the first token)
                if echoes and echoes[index] and scored is None:
                    await _send(response, renderer.delta(index, echoes[index]))
            async for index, event in batch.events():
                if isinstance(event, TokenChunk):
                    if scored is not None and event.prompt_logprobs is not None:
                        prompt = scored(index, event.prompt_logprobs)
                        echo = echoes[index] if echoes else ""
                        await _send(response, renderer.prompt_delta(index, echo, prompt))
                    # a partial character yields no text: no empty delta, unless logprobs
                    if event.text or event.logprobs:
                        await _send(response, renderer.delta(index, event.text, event.logprobs))
                elif isinstance(event, Finished):
                    done[index] = event
                    for chunk in renderer.finish_chunks(index, event.finish_reason):
                        await _send(response, chunk)
                else:
                    await _send(response, ApiError.from_failed(event).detail)
                    break
            else:
                if include_usage:
                    usage = oa.usage_of([f.usage for f in done if f is not None], n)
                    await _send(response, renderer.usage_chunk(usage))
            await response.write(b"data: [DONE]\n\n")
        except ConnectionResetError:
            pass  # the client left; closing the batch (finally, above) aborts the requests
        except Exception:
            log.exception("http_stream_error", request_id=renderer.request_id)
            error = ApiError(500, f"internal error in request {renderer.request_id}; the "
                             "router's log has details", code="internal")  # fmt: skip
            with suppress(ConnectionResetError):
                await _send(response, error.detail)
                await response.write(b"data: [DONE]\n\n")
        return response


class _ScoringOnly(Batch):
    """A batch whose generated tokens are not part of the answer (completions with
    max_tokens 0 and echo): chunks keep only the prompt's logprobs, usage counts none."""

    async def events(self) -> AsyncIterator[tuple[int, Event]]:
        async for index, event in super().events():
            if isinstance(event, TokenChunk):
                event = msgspec.structs.replace(event, token_ids=[], text="", logprobs=[])
            elif isinstance(event, Finished):
                usage = msgspec.structs.replace(event.usage, completion_tokens=0)
                event = msgspec.structs.replace(event, usage=usage, finish_reason="length")
            yield index, event


async def _send(response: web.StreamResponse, event: msgspec.Struct | None) -> None:
    if event is None:
        return
    if isinstance(event, oa.ErrorDetail):
        event = oa.ErrorBody(error=event)
    await response.write(b"data: " + msgspec.json.encode(event) + b"\n\n")


def _completion_prompts(core: RouterCore, prompt: str | list[Any]) -> list[list[int]]:
    """OpenAI's four prompt shapes -> one token list per choice."""
    if isinstance(prompt, str):
        prompts = [core.tokenizer.encode(prompt)]
    elif all(isinstance(p, str) for p in prompt):
        prompts = [core.tokenizer.encode(p) for p in prompt]
    elif all(isinstance(p, int) for p in prompt):
        prompts = [list(prompt)]
    elif all(isinstance(p, list) for p in prompt):
        prompts = list(prompt)
    else:
        raise ApiError(400, "prompt: a list must hold only strings, only token ids, or only "
                       "lists of token ids", param="prompt", code="invalid_value")  # fmt: skip
    vocab = core.tokenizer.vocab_size
    for i, ids in enumerate(prompts):
        if not ids:
            raise ApiError(400, f"prompt {i} is empty", param="prompt", code="invalid_value")
        bad = next((t for t in ids if t >= vocab), None)
        if bad is not None:
            raise ApiError(400, f"prompt {i}: token id {bad} is outside the vocabulary "
                           f"(0..{vocab - 1})", param="prompt", code="invalid_value")  # fmt: skip
    return prompts


def _completion_echoes(core: RouterCore, prompt: str | list[Any],
                       prompts: list[list[int]]) -> list[str]:  # fmt: skip
    """echo: each prompt's text as given, or its token ids decoded."""
    if isinstance(prompt, str):
        return [prompt]
    if all(isinstance(p, str) for p in prompt):
        return list(prompt)
    return [core.tokenizer.decode(ids) for ids in prompts]


def _content_text(content: str | list[oa.ContentPart] | None, index: int = 0) -> str:
    if not isinstance(content, list):
        return content or ""  # OpenAI allows a null content; templates index it
    for part in content:
        if part.type != "text" or part.text is None:
            raise ApiError(400, f"messages[{index}]: only text content parts are "
                           f"supported, got type {part.type!r}", code="invalid_value",
                           param=f"messages[{index}].content")  # fmt: skip
    # As vLLM does for string templates: the parts of one message, one per line.
    return "\n".join(part.text for part in content if part.text is not None)


_RESERVED_TEMPLATE_VARS = frozenset({"messages", "tools", "documents", "add_generation_prompt"})


def _chat_prompt(core: RouterCore, req: oa.ChatCompletionRequest) -> list[int]:
    chat = template_messages([{"role": m.role, "content": _content_text(m.content, i),
                               "name": m.name, "tool_calls": m.tool_calls,
                               "tool_call_id": m.tool_call_id}
                              for i, m in enumerate(req.messages)])  # fmt: skip
    kwargs = req.chat_template_kwargs or {}
    reserved = sorted(_RESERVED_TEMPLATE_VARS & set(kwargs))
    if reserved:
        raise ApiError(400, f"chat_template_kwargs cannot set {', '.join(reserved)}; use the "
                       "request's own fields", param="chat_template_kwargs",
                       code="invalid_value")  # fmt: skip
    try:
        text = core.tokenizer.apply_chat_template(chat, req.wants_generation_prompt, kwargs,
                                                  tools=req.tools or None)  # fmt: skip
    except PdserveError as exc:
        raise ApiError(400, str(exc), param="messages", code="invalid_value") from None
    if req.continue_final_message:
        if not chat:
            raise ApiError(400, "continue_final_message needs a final message to continue; "
                           "messages is empty", param="messages", code="invalid_value")  # fmt: skip
        # As transformers does: end the text right after the final message's content, so
        # the model continues it instead of closing the turn.
        final = (chat[-1]["content"] or "").strip()
        at = text.rfind(final) if final else -1
        if at < 0:
            raise ApiError(400, "continue_final_message: the final message's content is not "
                           "found in the rendered prompt (is it empty?)",
                           param="continue_final_message", code="invalid_value")  # fmt: skip
        text = text[: at + len(final)]
    # The template already wrote BOS and friends as text; adding them again would double them.
    ids = core.tokenizer.encode(text, add_special_tokens=False)
    if not ids:
        raise ApiError(
            400, "the messages render to an empty prompt", param="messages", code="invalid_value"
        )
    return ids


def _package_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("pdserve")
    except PackageNotFoundError:  # a source tree that was never installed
        return "0+unknown"


def make_app(core: RouterCore, *, served_model_names: Sequence[str] = (), api_key: str = "",
             allowed_origins: Sequence[str] = (), tool_call_parser: str = "auto",
             pool: TokenizePool | None = None, max_prompts: int = 128,
             max_body_bytes: int = MAX_BODY_BYTES) -> web.Application:  # fmt: skip
    """``served_model_names``: the model ids clients may use (empty: the core's);
    ``api_key``: when set, every route but OPEN_PATHS wants ``Authorization: Bearer``;
    ``allowed_origins``: browser origins CORS lets in ("*": any; empty: CORS off)."""
    middlewares: list[Any] = [_error_middleware]
    if api_key:
        middlewares.append(_key_middleware(api_key))
    app = web.Application(
        middlewares=middlewares,
        client_max_size=max_body_bytes,
        handler_args={"handler_cancellation": True},  # disconnect -> cancel -> abort
    )
    if allowed_origins:
        Cors(allowed_origins).install(app)
    app[MAX_BODY_KEY] = max_body_bytes
    api = OpenAIApi(core, served_model_names, tool_call_parser, pool, max_prompts)
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
