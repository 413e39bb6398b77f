"""What the engine reports per request per step, and the stop rules that end a request."""

from __future__ import annotations

import msgspec

from pdserve.common.engine.request import Request
from pdserve.common.engine.sampling_params import TokenLogprobs
from pdserve.common.model.checkpoint.tokenizer import IncrementalDetokenizer, Tokenizer


class RequestOutput(msgspec.Struct, kw_only=True):
    request_id: str
    new_token_ids: list[int]
    text: str  # the new text since the last output
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_output_tokens: int = 0
    logprobs: list[TokenLogprobs] = []  # one per new token, when the request asked for them
    # on the first token's output, when asked for: entry i is prompt token i + 1's
    prompt_logprobs: list[TokenLogprobs] | None = None


class Completion(msgspec.Struct, kw_only=True):
    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str | None
    num_prompt_tokens: int
    num_cached_tokens: int


class TextTracker:
    """Incremental text of one request, holding back what could still become a stop string."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        stop: tuple[str, ...],
        *,
        min_tokens: int = 0,
        include_stop: bool = False,
    ) -> None:
        self.detok = IncrementalDetokenizer(tokenizer)
        self.stop = stop
        self.min_tokens = min_tokens  # stop strings only count from this many tokens on
        self.include_stop = include_stop  # keep the stop string that ended the text
        self.num_tokens = 0
        self.holdback = max((len(s) for s in stop), default=1) - 1
        self.text = ""
        self.emitted = 0
        self.stopped = False  # a stop string ended the text: nothing after it counts

    def add(self, token_id: int) -> tuple[str, bool]:
        """The text that is now safe to emit, and whether a stop string was hit."""
        if not self.stop:  # nothing held back: the new text is emitted as it comes
            self.num_tokens += 1
            return self.detok.add(token_id), False
        self.text += self.detok.add(token_id)
        self.num_tokens += 1
        if self.stop and self.num_tokens >= self.min_tokens:
            search_from = max(0, self.emitted - self.holdback)
            hits = [
                (i, len(s)) for i, s in ((self.text.find(s, search_from), s) for s in self.stop)
                if i >= 0
            ]  # fmt: skip
            if hits:
                start, length = min(hits)
                self.text = self.text[: start + length if self.include_stop else start]
                self.stopped = True
                return self._take(), True
        safe = len(self.text) - self.holdback if self.stop else len(self.text)
        delta = self.text[self.emitted : max(safe, self.emitted)]
        self.emitted += len(delta)
        return delta, False

    def flush(self) -> str:
        """Everything not yet emitted; called once when the request ends."""
        if not self.stopped:
            self.text += self.detok.flush()
        return self._take()

    def _take(self) -> str:
        delta = self.text[self.emitted :]
        self.emitted = len(self.text)
        return delta


def finish_reason(
    req: Request, token_id: int, eos_token_ids: frozenset[int], max_model_len: int
) -> str | None:
    """Why ``req`` ends after sampling ``token_id`` (stop strings are checked on text)."""
    p = req.sampling
    if len(req.output_token_ids) < p.min_tokens:  # the sampler kept stop tokens out
        return "length" if req.num_tokens >= max_model_len else None
    if token_id in p.stop_token_ids or (not p.ignore_eos and token_id in eos_token_ids):
        return "stop"
    if len(req.output_token_ids) >= p.max_tokens or req.num_tokens >= max_model_len:
        return "length"
    return None
