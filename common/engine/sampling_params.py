"""Sampling parameters: wire-safe and free of torch, so the router and SDK stay light."""

from __future__ import annotations

import math
from collections.abc import Sequence

import msgspec

from pdserve.common.errors import RequestError

MAX_LOGIT_BIAS = 100.0  # OpenAI's range for one logit_bias value: [-100, 100]
MAX_LOGPROBS = 20  # alternatives per token, at most (OpenAI's top_logprobs limit)


class TokenLogprobs(msgspec.Struct, array_like=True):
    """One sampled token's log-probability and the ``n`` most likely alternatives, from
    the log-softmax of the model's raw logits (before penalties, bias and temperature:
    vLLM's default, "raw_logprobs"). Array-like: it rides on every token chunk; new
    fields only ever at the end."""

    token_id: int
    logprob: float
    top_ids: list[int] = []  # most likely first
    top_logprobs: list[float] = []


STRUCTURED_KINDS = ("json", "json_object", "regex", "choice", "grammar")


SAMPLING_EPS = 1e-5  # temperatures below this are greedy


class StructuredOutput(msgspec.Struct, frozen=True, kw_only=True):
    """A constraint on the output: ``json`` (spec: a JSON schema), ``json_object`` (any
    JSON object), ``regex``, ``choice`` (spec: a JSON list of strings), ``grammar``
    (xgrammar's EBNF)."""

    kind: str
    spec: str = ""
    # Reasoning models (services/router/reasoning.py): the answer follows a free thinking
    # part, and the grammar holds from the token after ``think_end_id`` on. With
    # ``think_start_id`` the thinking is the model's choice: it thinks only when its first
    # token is that one (which the first step's mask allows), else the grammar holds from
    # the first token.
    think_end_id: int | None = None
    think_start_id: int | None = None

    def constrained(self, output: Sequence[int]) -> Sequence[int] | None:
        """The part of ``output`` the grammar has taken; None while the model thinks."""
        if self.think_end_id is None:
            return output
        if self.think_start_id is not None:
            if not output or output[0] != self.think_start_id:
                return output  # it did not open a thinking part: constrained throughout
        if self.think_end_id not in output:
            return None
        return output[output.index(self.think_end_id) + 1 :]


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True):
    """Map-like on the wire, so fields added later (with defaults) stay compatible."""

    max_tokens: int = 16
    temperature: float = 0.0  # 0 means greedy
    top_k: int = 0  # 0 or -1: off
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    # Logit adjustments, applied before greedy picks too (as vLLM and OpenAI do):
    presence_penalty: float = 0.0  # OpenAI's: minus this once for a token already generated
    frequency_penalty: float = 0.0  # OpenAI's: minus this per earlier generation of the token
    repetition_penalty: float = 1.0  # CTRL's / HF's, over prompt and output tokens; 1: off
    logit_bias: dict[int, float] = {}  # token id -> added to its logit
    min_tokens: int = 0  # EOS and stop tokens/strings are not allowed before this many
    min_p: float = 0.0  # drop tokens less likely than min_p x the most likely one
    include_stop_str_in_output: bool = False  # keep the stop string (or stop token's text)
    logprobs: int | None = None  # None: none; n: each token's logprob and n alternatives
    structured: StructuredOutput | None = None  # grammar-constrained output (structured.py)
    # None: none; n: each prompt token's logprob (given those before) and n alternatives
    prompt_logprobs: int | None = None

    @property
    def is_greedy(self) -> bool:
        # Below SAMPLING_EPS dividing by the temperature overflows to inf and the
        # softmax to NaN: such a temperature means greedy (as vLLM's _SAMPLING_EPS).
        return self.temperature < SAMPLING_EPS

    @property
    def adjusts_logits(self) -> bool:
        """Whether a row needs more than temperature / top-k / top-p (the slow path)."""
        return bool(
            self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
            or self.logit_bias
            or self.min_tokens
            or self.structured
        )

    def validate(self, vocab_size: int | None = None) -> None:
        """``vocab_size``, when known, bounds the token ids of logit_bias and stop_token_ids."""
        if self.max_tokens < 1:
            raise RequestError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if not 0 <= self.temperature < math.inf:  # NaN too: it would poison the whole batch
            raise RequestError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise RequestError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise RequestError(f"top_k must be -1, 0 (off) or positive, got {self.top_k}")
        if any(not s for s in self.stop):
            raise RequestError("stop strings must not be empty")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:  # OpenAI's range
                raise RequestError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not 0.0 < self.repetition_penalty < math.inf:
            raise RequestError(
                f"repetition_penalty must be a finite number > 0 (1: off), "
                f"got {self.repetition_penalty}"
            )
        if not 0.0 <= self.min_p <= 1.0:
            raise RequestError(f"min_p must be in [0, 1], got {self.min_p}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise RequestError(
                f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}"
            )
        if self.structured is not None and self.structured.kind not in STRUCTURED_KINDS:
            raise RequestError(
                f"structured output kind must be one of {', '.join(STRUCTURED_KINDS)}, "
                f"got {self.structured.kind!r}"
            )
        if self.structured is not None and vocab_size is not None:
            for name in ("think_end_id", "think_start_id"):
                token = getattr(self.structured, name)
                if token is not None and not 0 <= token < vocab_size:
                    raise RequestError(f"structured.{name}: token id {token} is outside "
                                       f"the vocabulary (0..{vocab_size - 1})")  # fmt: skip
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= MAX_LOGPROBS:
                raise RequestError(f"{name} must be in [0, {MAX_LOGPROBS}], got {value}")
        for token, bias in self.logit_bias.items():
            if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise RequestError(f"logit_bias[{token}] must be in [-100, 100], got {bias}")
        if vocab_size is not None:
            for name, ids in (
                ("logit_bias", self.logit_bias),
                ("stop_token_ids", self.stop_token_ids),
            ):
                bad = next((t for t in ids if not 0 <= t < vocab_size), None)
                if bad is not None:
                    raise RequestError(
                        f"{name}: token id {bad} is outside the vocabulary (0..{vocab_size - 1})"
                    )
