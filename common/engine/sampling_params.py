"""Sampling parameters: wire-safe and free of torch, so the router and SDK stay light."""

from __future__ import annotations

import math

import msgspec

from pdserve.common.errors import RequestError


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True):
    max_tokens: int = 16
    temperature: float = 0.0  # 0 means greedy
    top_k: int = 0  # 0 or -1: off
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self) -> None:
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
