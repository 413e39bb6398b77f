"""A generation's events as the HTTP answer: one JSON body (`collect`: n choices, the
best_of most likely kept) or server-sent events (`stream`), each over a core `Batch`."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import suppress

import msgspec
import structlog
from aiohttp import web

from pdserve.common.engine.sampling_params import TokenLogprobs
from pdserve.common.runtime.protocol import Finished, TokenChunk
from pdserve.services.router import openai_schema as oa
from pdserve.services.router.core_api import Batch, Event
from pdserve.services.router.http_errors import ECHO_ID, ApiError, json_response
from pdserve.services.router.renderers import PromptScored, Renderer

log = structlog.get_logger("pdserve.router.http")

# a choice's index and its prompt's logprobs -> how to show them
ScoredPrompt = Callable[[int, list[TokenLogprobs]], PromptScored]


async def collect(batch: Batch, renderer: Renderer, num_choices: int, n: int,
                  echoes: list[str] | None, keep: int, show_logprobs: bool,
                  scored: ScoredPrompt | None = None) -> web.Response:  # fmt: skip
    """``n`` candidates per prompt, of which the ``keep`` most likely are answered."""
    texts: list[list[str]] = [[e] for e in echoes] if echoes else [[] for _ in range(num_choices)]
    thoughts: list[list[str]] = [[] for _ in range(num_choices)]
    logprobs: list[list[TokenLogprobs]] = [[] for _ in range(num_choices)]
    prompts: list[PromptScored | None] = [None] * num_choices
    finished: list[Finished | None] = [None] * num_choices
    async for index, event in batch.events():
        if isinstance(event, TokenChunk):
            # as a stream splits it (renderer.delta), so both give the same thinking
            thought, text = renderer.split(index, event.token_ids, event.text)
            texts[index].append(text)
            thoughts[index].append(thought)
            logprobs[index] += event.logprobs
            if scored is not None and event.prompt_logprobs is not None:
                prompts[index] = scored(index, event.prompt_logprobs)
        elif isinstance(event, Finished):
            finished[index] = event
        else:
            raise ApiError.from_failed(event)
    done = [f for f in finished if f is not None]
    # every candidate was generated
    usage = oa.usage_of([f.usage for f in done], n, renderer.reasoning_tokens())
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
        ["".join(thoughts[i]) for i in chosen],
    )
    return json_response(body)


async def stream(
    request: web.Request, batch: Batch, renderer: Renderer, include_usage: bool,
    num_choices: int, n: int, echoes: list[str] | None, scored: ScoredPrompt | None = None,
    submit_rest: Callable[[], Awaitable[None]] | None = None,
) -> web.StreamResponse:  # fmt: skip
    """Headers at once, then the events. ``submit_rest``: submits what waits for the first
    events (best_of / n candidates); its ApiError is an SSE error event."""
    response = web.StreamResponse(headers={
        "Content-Type": "text/event-stream", "Cache-Control": "no-cache",
        "X-Accel-Buffering": "no",  # proxies must not hold back events
        "x-request-id": ECHO_ID.get() or renderer.request_id,
    })  # fmt: skip
    await response.prepare(request)
    done: list[Finished | None] = [None] * num_choices
    try:
        for index in range(num_choices):
            await send_event(response, renderer.start(index))
            # with prompt logprobs the echo waits for them (they come with the first token)
            if echoes and echoes[index] and scored is None:
                await send_event(response, renderer.delta(index, echoes[index]))
        if submit_rest is not None:
            await submit_rest()
        async for index, event in batch.events():
            if isinstance(event, TokenChunk):
                if scored is not None and event.prompt_logprobs is not None:
                    prompt = scored(index, event.prompt_logprobs)
                    echo = echoes[index] if echoes else ""
                    await send_event(response, renderer.prompt_delta(index, echo, prompt))
                # a partial character or a marker alone: the renderer sends nothing
                await send_event(response, renderer.delta(index, event.text, event.logprobs,
                                                          event.token_ids))  # fmt: skip
            elif isinstance(event, Finished):
                done[index] = event
                for chunk in renderer.finish_chunks(index, event.finish_reason):
                    await send_event(response, chunk)
            else:
                await send_event(response, ApiError.from_failed(event).detail)
                break
        else:
            if include_usage:
                usage = oa.usage_of([f.usage for f in done if f is not None], n,
                                    renderer.reasoning_tokens())  # fmt: skip
                await send_event(response, renderer.usage_chunk(usage))
        await response.write(b"data: [DONE]\n\n")
    except ConnectionResetError:
        pass  # the client left; closing the batch (finally, above) aborts the requests
    except ApiError as exc:  # refused after the headers: the answer's last event says so
        with suppress(ConnectionResetError):
            await send_event(response, exc.detail)
            await response.write(b"data: [DONE]\n\n")
    except Exception:
        log.exception("http_stream_error", request_id=renderer.request_id)
        error = ApiError(500, f"internal error in request {renderer.request_id}; the "
                         "router's log has details", code="internal")  # fmt: skip
        with suppress(ConnectionResetError):
            await send_event(response, error.detail)
            await response.write(b"data: [DONE]\n\n")
    return response


class ScoringOnly(Batch):
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


async def send_event(response: web.StreamResponse, event: msgspec.Struct | None) -> None:
    if event is None:
        return
    if isinstance(event, oa.ErrorDetail):
        event = oa.ErrorBody(error=event)
    await response.write(b"data: " + msgspec.json.encode(event) + b"\n\n")
