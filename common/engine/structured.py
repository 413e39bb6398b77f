"""Grammar-constrained sampling (structured output) with xgrammar, on CPU or GPU logits.

One ``GrammarMatcher`` per request, made on the first step that samples for it and fed
the request's output tokens so far: on prefill that is the first token; on decode the
matcher first takes the token prefill sampled, so both services constrain the same
sequence without shipping matcher state. Each step fills the row's token bitmask, masks
the logits (before penalties and sampling), and the matcher then accepts the chosen
token. Once the grammar is complete only a stop token is allowed. A reasoning model's
grammar (``StructuredOutput.think_end_id``) has no matcher while the model thinks; the
first step after the end marker makes it from the tokens after the marker, on either
service alike.

xgrammar (and transformers, for the tokenizer's vocabulary) are imported on the first
structured request, so engines that never see one do not pay the ~10 s import. Measured
cost on the embedded model: compiling a small JSON schema ~30 ms (cached by xgrammar),
filling one bitmask ~0.1 ms a token.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

from pdserve.common.engine.sampling_params import StructuredOutput
from pdserve.common.errors import RequestError


class GrammarTable:
    def __init__(self, model_dir: Path, vocab_size: int) -> None:
        self.model_dir = model_dir
        self.vocab_size = vocab_size  # the logits' width (may exceed the tokenizer's)
        self._xgr: Any = None
        self._compiler: Any = None
        self._matchers: dict[str, Any] = {}

    def _load(self) -> None:
        if self._compiler is not None:
            return
        try:
            import xgrammar as xgr
            from transformers import AutoTokenizer
        except ImportError as exc:
            raise RequestError(
                "structured output needs the xgrammar package where prefill and decode run "
                f"(pip install xgrammar): {exc}"
            ) from None
        tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=self.vocab_size)
        self._xgr, self._compiler = xgr, xgr.GrammarCompiler(info)

    def compile(self, spec: StructuredOutput) -> Any:
        """The compiled grammar (xgrammar caches it); a bad spec is a RequestError."""
        self._load()
        compiler = self._compiler
        try:
            if spec.kind == "json_object":
                return compiler.compile_builtin_json_grammar()
            if spec.kind == "json":
                return compiler.compile_json_schema(spec.spec, any_whitespace=False)
            if spec.kind == "regex":
                return compiler.compile_regex(spec.spec)
            if spec.kind == "choice":
                choices = json.loads(spec.spec)
                return compiler.compile_grammar("root ::= " + " | ".join(map(json.dumps, choices)))
            if spec.kind == "grammar":
                return compiler.compile_grammar(spec.spec)
        except (RuntimeError, ValueError, TypeError) as exc:
            message = " ".join(str(exc).split())[:500]
            raise RequestError(f"the {spec.kind} constraint does not compile: {message}") from None
        raise RequestError(f"unknown structured output kind {spec.kind!r}")

    def mask(
        self,
        logits: torch.Tensor,  # [V], masked in place
        request_id: str,
        spec: StructuredOutput,
        output: Sequence[int],
    ) -> None:
        matcher = self._matchers.get(request_id)
        if matcher is None:
            constrained = spec.constrained(output)
            if constrained is None:  # a reasoning model thinking: free until its end marker
                return
            matcher = self._xgr_matcher(spec)
            for token in constrained:  # decode: the token(s) sampled elsewhere first
                matcher.accept_token(token)
            self._matchers[request_id] = matcher
        xgr = self._xgr
        bitmask = xgr.allocate_token_bitmask(1, self.vocab_size)  # [1, ceil(V / 32)] int32
        matcher.fill_next_token_bitmask(bitmask, 0)
        if spec.think_start_id is not None and not output:  # the model may open its thinking
            word, bit = divmod(spec.think_start_id, 32)
            bitmask[0, word] |= _bit(bit)
        if logits.device.type == "cpu":
            xgr.apply_token_bitmask_inplace(logits[None], bitmask)
        else:
            xgr.apply_token_bitmask_inplace(logits[None], bitmask.to(logits.device))

    def _xgr_matcher(self, spec: StructuredOutput) -> Any:
        compiled = self.compile(spec)  # loads xgrammar on first use
        return self._xgr.GrammarMatcher(compiled)

    def accept(self, request_id: str, token: int, spec: StructuredOutput,
               output: Sequence[int]) -> None:  # fmt: skip
        """``token`` sampled after ``output``."""
        matcher = self._matchers.get(request_id)
        if matcher is None:
            return
        if not output and token == spec.think_start_id:
            # it opened its thinking: the grammar waits for the end marker (mask makes
            # the matcher anew then, from the tokens after it)
            del self._matchers[request_id]
        elif not matcher.is_terminated():
            matcher.accept_token(token)

    def prune(self, live: Iterable[str]) -> None:
        """Forget matchers of requests that ended (finished, aborted, handed to decode)."""
        keep = set(live)
        for request_id in [r for r in self._matchers if r not in keep]:
            del self._matchers[request_id]

    @property
    def num_matchers(self) -> int:
        return len(self._matchers)


def _bit(index: int) -> int:
    """Bit ``index`` of an int32 bitmask word, as the signed value torch stores."""
    return (1 << index) - (1 << 32) if index == 31 else 1 << index
