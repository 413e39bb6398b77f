"""A generation request's candidates, from its token ids to its HTTP answer: one
``Generate`` per candidate (best_of, else n, per prompt), each with max_tokens fitted to
max_model_len, submitted to the core in stages (the first candidate of each prompt first,
so the others reuse its prompt's blocks through the prefix cache), then answered as one
JSON body or as server-sent events (http_answers).

The answer's status is decided by the first event of every candidate: a refusal at
``submit`` (429, 503, 400) or a first ``Failed``. A stream sends its headers once its
first stage is admitted, before any token is computed."""

from __future__ import annotations

from collections.abc import Sequence

from aiohttp import web

from pdserve.common.engine.sampling_params import TokenLogprobs
from pdserve.common.runtime.protocol import Failed, Generate
from pdserve.services.router import openai_schema as oa
from pdserve.services.router.core_api import Batch, Refused, RouterCore
from pdserve.services.router.http_answers import ScoredPrompt, ScoringOnly, collect, stream
from pdserve.services.router.http_errors import CLIENT_KEY, ApiError
from pdserve.services.router.renderers import ChatRenderer, PromptScored, Renderer


def fit_max_tokens(max_model_len: int, prompt: list[int], prompt_param: str,
                   default: int | None, requested: int | None) -> int:  # fmt: skip
    """A candidate's max_tokens: the requested one when the prompt leaves room for it,
    else a 400; none requested: ``default`` within the room (none: all of it)."""
    limit = max_model_len
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


async def generate(
    core: RouterCore,
    request: web.Request,
    req: oa.SamplingRequest,
    prompts: list[list[int]],
    renderer: Renderer,
    in_flight: set[str],
    *,
    default_max_tokens: int | None = None,
    requested_max_tokens: int | None = None,
    echoes: list[str] | None = None,
    scoring_only: bool = False,
    gate: oa.Gate | None = None,
) -> web.StreamResponse:
    """``in_flight``: the HTTP request ids now running (the candidates' are in it until the
    answer ends). ``scoring_only``: the generated token is left out of the answer
    (max_tokens 0). ``gate``: where a constraint starts (after a reasoning model's
    thinking). One Generate per candidate: best_of (else n) per prompt, index = prompt
    index x n + j (the n requests share the prompt's KV blocks through the prefix cache)."""
    n = req.num_candidates
    num_choices = len(prompts) * n
    ids = [renderer.request_id] if num_choices == 1 else [
        f"{renderer.request_id}-{i}" for i in range(num_choices)
    ]  # fmt: skip
    gens = []
    prompt_param = "messages" if isinstance(renderer, ChatRenderer) else "prompt"
    vocab = core.tokenizer.vocab_size
    for index, request_id in enumerate(ids):
        prompt = prompts[index // n]
        max_tokens = fit_max_tokens(core.max_model_len, prompt, prompt_param,
                                    default_max_tokens, requested_max_tokens)  # fmt: skip
        sampling = req.sampling(max_tokens, index % n, gate)
        sampling.validate(vocab)  # the core checks again; failing here names no peer
        gens.append(Generate(request_id=request_id, prompt_token_ids=prompt,
                             sampling=sampling, stream=req.is_stream,
                             priority=req.priority or 0))  # fmt: skip
    choice_echoes = None if echoes is None else [echoes[i // n] for i in range(num_choices)]
    scored: ScoredPrompt | None = None
    if req.requested_prompt_logprobs is not None:
        show_echo = bool(getattr(req, "echo", False)) and req.requested_logprobs is not None
        show_field = getattr(req, "prompt_logprobs", None) is not None

        def scored(index: int, lps: list[TokenLogprobs]) -> PromptScored:
            return PromptScored(token_ids=prompts[index // n], logprobs=lps,
                                echo=show_echo, vllm_field=show_field)  # fmt: skip

    batch = ScoringOnly() if scoring_only else Batch()
    # whose turn it is in the router (fair admission): its API key, else its address;
    # the body's ``user`` within that where the operator trusts it (trust_user_field)
    owner = request.get(CLIENT_KEY) or f"http:{request.remote}"
    if req.user and core.trust_user_field:
        owner = f"user:{req.user}" if owner.startswith("http:") else f"{owner}/user:{req.user}"
    in_flight.update(ids)
    # The first candidate of each prompt first: once it has a token, its prompt's
    # blocks are in the prefix cache, and the other n - 1 (sent to the same prefill by
    # prefix affinity) reuse them instead of computing the prompt again.
    stages = [range(0, num_choices, n)] + ([] if n == 1 else [
        [i for i in range(num_choices) if i % n]
    ])  # fmt: skip

    def submit(stage: Sequence[int]) -> None:
        for index in stage:
            try:
                batch.add(core.submit(gens[index], owner=owner), index)
            except Refused as exc:
                raise ApiError.of_reason(exc.reason, f"request {gens[index].request_id}: "
                                         f"{exc}") from None  # fmt: skip

    async def submit_rest() -> None:
        for stage in stages[1:]:
            for event in await batch.first_events():
                if isinstance(event, Failed):
                    raise ApiError.from_failed(event)
            submit(stage)

    try:
        submit(stages[0])  # a refusal is the answer's status
        if req.is_stream:  # headers now: the first token may wait for its turn
            return await stream(request, batch, renderer, req.include_usage,
                                num_choices, n, choice_echoes, scored,
                                submit_rest)  # fmt: skip
        await submit_rest()
        for event in await batch.first_events():
            if isinstance(event, Failed):
                raise ApiError.from_failed(event)
        return await collect(batch, renderer, num_choices, n, choice_echoes,
                             req.num_choices, req.requested_logprobs is not None,
                             scored)  # fmt: skip
    finally:
        await batch.close()
        in_flight.difference_update(ids)
