"""``speculative_config``: vLLM's spelling, validated once (no torch here: the router and
the config loader import it)."""

from __future__ import annotations

import msgspec

from pdserve.common.errors import PdserveError

METHODS = ("ngram", "draft_model", "mtp", "dspark")


class SpeculativeConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """``{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4,
    "prompt_lookup_min": 2}`` or ``{"method": "draft_model", "model": PATH,
    "num_speculative_tokens": 5}`` or ``{"method": "mtp", "num_speculative_tokens": 1}``
    (a DeepSeek checkpoint's own multi-token-prediction layer) or ``{"method": "dspark",
    "model": PATH, "num_speculative_tokens": 5, "confidence_threshold": 0.5}`` (a DeepSpec
    DSpark draft; a DeepSeek-V4 target without 'model' drafts with its own checkpoint's
    DSpark module; the confidence head may verify fewer). Every decode step proposes exactly
    ``num_speculative_tokens`` tokens a sequence (fewer only where max_tokens or
    max_model_len leave less room) and the target verifies them in one forward."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_max: int | None = None  # ngram: longest suffix matched (default 4)
    prompt_lookup_min: int | None = None  # ngram: shortest suffix matched (default 1)
    model: str | None = None  # draft_model: HF directory or GGUF file; dspark: its directory
    # dspark: verify the drafts up to the first whose confidence (the sigmoid of the
    # confidence head) is below this; 0 (default) or a draft without the head: all of them
    confidence_threshold: float | None = None

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise PdserveError(
                f"speculative_config: unknown method {self.method!r}; choose one of "
                f"{', '.join(METHODS)}"
            )
        if self.num_speculative_tokens < 1:
            raise PdserveError(
                "speculative_config: num_speculative_tokens must be at least 1, "
                f"got {self.num_speculative_tokens}"
            )
        if self.confidence_threshold is not None:
            if self.method != "dspark":
                raise PdserveError(
                    "speculative_config: confidence_threshold belongs to method 'dspark'"
                )
            if not 0.0 <= self.confidence_threshold <= 1.0:
                raise PdserveError(
                    "speculative_config: confidence_threshold must be within [0, 1], got "
                    f"{self.confidence_threshold}"
                )
        if self.method == "ngram":
            if self.model is not None:
                raise PdserveError("speculative_config: method 'ngram' takes no 'model'")
            if self.lookup_min < 1 or self.lookup_max < self.lookup_min:
                raise PdserveError(
                    "speculative_config: need 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                    f"{self.prompt_lookup_min} and {self.prompt_lookup_max}"
                )
        elif self.method == "mtp":
            if self.model is not None:
                raise PdserveError(
                    "speculative_config: method 'mtp' takes no 'model' (it drafts with the "
                    "target checkpoint's own multi-token-prediction layer)"
                )
            if self.prompt_lookup_max is not None or self.prompt_lookup_min is not None:
                raise PdserveError(
                    "speculative_config: prompt_lookup_max/min belong to method 'ngram'"
                )
        elif self.method == "dspark":
            # 'model': a DeepSpec draft directory (Qwen3 targets; the proposer refuses its
            # absence), or for a DeepSeek-V4 target another V4 checkpoint with a DSpark
            # module (default: the target's own mtp.* weights)
            if self.prompt_lookup_max is not None or self.prompt_lookup_min is not None:
                raise PdserveError(
                    "speculative_config: prompt_lookup_max/min belong to method 'ngram'"
                )
        else:
            if not self.model:
                raise PdserveError(
                    "speculative_config: method 'draft_model' needs 'model' (an HF directory "
                    "or GGUF file of a smaller model with the target's tokenizer)"
                )
            if self.prompt_lookup_max is not None or self.prompt_lookup_min is not None:
                raise PdserveError(
                    "speculative_config: prompt_lookup_max/min belong to method 'ngram'"
                )

    @property
    def threshold(self) -> float:
        return self.confidence_threshold or 0.0

    @property
    def lookup_max(self) -> int:
        return 4 if self.prompt_lookup_max is None else self.prompt_lookup_max

    @property
    def lookup_min(self) -> int:
        return 1 if self.prompt_lookup_min is None else self.prompt_lookup_min


def parse_speculative_config(text: str) -> SpeculativeConfig:
    """The ``--speculative-config`` flag's JSON."""
    try:
        return msgspec.json.decode(text.encode(), type=SpeculativeConfig)
    except msgspec.ValidationError as exc:
        raise PdserveError(f"invalid --speculative-config: {exc}") from exc
    except msgspec.DecodeError as exc:
        raise PdserveError(f"--speculative-config is not valid JSON: {exc}") from exc
