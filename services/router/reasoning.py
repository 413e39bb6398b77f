"""Reasoning models: their thinking split from the answer, on token ids.

Qwen3 and DeepSeek-R1 / V3.1 / V4 / V4.1 think between ``<think>`` and ``</think>``, each one token
of their vocabularies. The split watches for those ids (never for their text, which a
stream can cut anywhere and which a user's text can spell), then cuts the engine's text
where each marker's token begins and ends: the length of the output decoded up to the
marker, which is where the engine's incremental text has it. So stop strings, partial
characters held back and special tokens the text skips all stay the engine's business.

Where a choice starts is read off the prompt's tail (the generation prompt the template
added): a start marker last (R1, V3.1 / V4 thinking, Qwen3-Thinking) opens in thinking, an
end marker last (Qwen3 ``enable_thinking: false``, V3.1 / V4 chat mode) in the answer.
With neither, ``deepseek_r1`` thinks from the first token (R1 models that skip
``<think>``) and the others answer unless the first token opens the thinking.

DeepSeek-V3.1, V4 and V4.1 think between the same two markers: their checkpoints' chat
encoders (``encoding/encoding_dsv4.py``; vLLM's ``deepseek_v4_encoding.py`` and
``deepseek_v41_encoding.py``) end a generation prompt with ``<｜Assistant｜><think>`` in
thinking mode and ``<｜Assistant｜></think>`` in chat mode, and vLLM's ``deepseek_v3``,
``deepseek_v4`` and ``deepseek_v41`` parsers split on them as R1's does when thinking is
on. So those names are this module's one ``<think>`` parser, as vLLM spells them. vLLM's
``deepseek_v4`` also ends the thinking where a DSML tool-call block (``<｜DSML｜tool_calls>``)
starts inside it, for its DSML tool parser; pdserve parses no DSML tool calls, so such a
block stays in the reasoning.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Literal

import msgspec

from pdserve.common.engine.sampling_params import StructuredOutput
from pdserve.common.errors import PdserveError
from pdserve.common.model.checkpoint.tokenizer import Tokenizer
from pdserve.common.runtime.service_config import REASONING_PARSERS

# name (the config's, checked there) -> whether the model thinks from its first token when
# the generation prompt holds no marker: R1 does; V3.1 / V4 / V4.1 think when their prompt
# opens the thinking (vLLM splits them only when the request turns thinking on), Qwen3 when
# it writes <think> first.
THINKS_UNPROMPTED = {"qwen3": False, "deepseek_r1": True, "deepseek_v3": False,
                     "deepseek_v31": False, "deepseek_v4": False, "deepseek_v41": False}  # fmt: skip
PARSERS = tuple(name for name in REASONING_PARSERS if name not in ("auto", "none"))
START, END = "<think>", "</think>"

Start = Literal["thinking", "answer", "maybe"]  # maybe: thinking only if the first token opens it
Part = Literal["reasoning", "content", "marker"]


class ReasoningParser(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    start_id: int
    end_id: int
    # no marker in the generation prompt: the model thinks from its first token (R1)
    thinks_unprompted: bool

    def start(self, prompt: Sequence[int], tail: Sequence[int] | None) -> Start:
        """Where a choice starts, from the generation prompt's ids (``tail``) or, without
        one (a continued final message), from the whole prompt: its last marker."""
        ids = prompt if tail is None else tail
        for token in reversed(ids):
            if token == self.start_id:
                return "thinking"
            if token == self.end_id:
                return "answer"
        return "thinking" if self.thinks_unprompted else "maybe"

    def gate(self, structured: StructuredOutput | None, start: Start) -> StructuredOutput | None:
        """A grammar that holds after the thinking, not over it."""
        if structured is None or start == "answer":
            return structured
        return msgspec.structs.replace(
            structured,
            think_end_id=self.end_id,
            think_start_id=self.start_id if start == "maybe" else None,
        )


def parser_of(name: str, tokenizer: Tokenizer) -> ReasoningParser | None:
    """``name`` (auto: read off the chat template; none: off) as a parser of this
    tokenizer; PdserveError when it cannot be one."""
    if name == "none":
        return None
    if name == "auto":
        name = detect(tokenizer.chat_template) or "none"
        if name == "none" or not _has_markers(tokenizer):
            return None
    if name not in PARSERS:
        raise PdserveError(f"reasoning_parser must be auto, none or one of {', '.join(PARSERS)}, "
                           f"got {name!r}")  # fmt: skip
    if not _has_markers(tokenizer):
        raise PdserveError(f"reasoning_parser {name!r} needs {START} and {END} to be single "
                          "tokens of the model's tokenizer; this one has no such tokens")  # fmt: skip
    vocab = tokenizer.vocab
    return ReasoningParser(name=name, start_id=vocab[START], end_id=vocab[END],
                           thinks_unprompted=THINKS_UNPROMPTED[name])  # fmt: skip


def detect(chat_template: str | None) -> str | None:
    """The parser a chat template calls for, when it says so unambiguously: thinking
    markers in a DeepSeek template (R1, V3.1) or a ChatML one (Qwen3)."""
    template = chat_template or ""
    if START not in template and END not in template:
        return None
    if "<｜Assistant｜>" in template:
        return "deepseek_r1"
    if "<|im_start|>" in template:
        return "qwen3"
    return None


def _has_markers(tokenizer: Tokenizer) -> bool:
    return all(tokenizer.encode(m, add_special_tokens=False) == [tokenizer.vocab.get(m)]
               for m in (START, END))  # fmt: skip


def template_reads(chat_template: str | None, name: str) -> bool:
    """Whether a chat template reads the variable ``name`` (a name, not part of one)."""
    return re.search(rf"(?<![\w.'\"]){name}\b", chat_template or "") is not None


def template_reads_key(chat_template: str | None, key: str) -> bool:
    """Whether a chat template reads ``key`` of a mapping (``m.key``, ``m['key']``)."""
    return re.search(rf"\.{key}\b|\[['\"]{key}['\"]\]", chat_template or "") is not None


class ThinkingSplit:
    """One choice's output as it comes: each chunk's text cut into its thinking and its
    answer. Markers are found by id; their place in the text is the length of the output
    decoded before and after them (``decode``: the engine's own, special tokens skipped)."""

    def __init__(self, parser: ReasoningParser, start: Start,
                 decode: Callable[[Sequence[int]], str]) -> None:  # fmt: skip
        self.parser = parser
        self.decode = decode
        self.thinking = start == "thinking"
        self.ids: list[int] = []
        self.num_reasoning_tokens = 0  # markers included: what the thinking cost
        # text offsets where a part begins, ascending: the engine's text is cut there
        self._bounds: list[tuple[int, Part]] = [(0, "reasoning" if self.thinking else "content")]
        self._offset = 0  # characters of the engine's text seen

    def feed(self, token_ids: Sequence[int], text: str) -> tuple[str, str]:
        """(thinking, answer) of a chunk: its tokens and the engine's text for them."""
        for token in token_ids:
            first = not self.ids
            self.ids.append(token)
            if first and token == self.parser.start_id:
                self._marker(True)
            elif self.thinking and token == self.parser.end_id:
                self._marker(False)
                self.num_reasoning_tokens += 1
            if self.thinking:
                self.num_reasoning_tokens += 1
        return self._cut(text)

    def _marker(self, thinking: bool) -> None:
        """The token just added is a marker: its text is hidden, the part after it is
        thinking or the answer."""
        # One decode of the output so far, once or twice a choice (~14 ms at 30k tokens):
        # the marker is a whole token, its text follows the text before it. Never behind
        # an earlier cut (a tokenizer whose prefix decodes disagree).
        before = max(len(self.decode(self.ids[:-1])), self._bounds[-1][0])
        after = before + len(self.decode(self.ids[-1:]))
        self._bounds.append((before, "marker"))
        self._bounds.append((max(before, after), "reasoning" if thinking else "content"))
        self.thinking = thinking

    def _cut(self, text: str) -> tuple[str, str]:
        parts: dict[Part, list[str]] = {"reasoning": [], "content": [], "marker": []}
        start, end = self._offset, self._offset + len(text)
        for i, (at, part) in enumerate(self._bounds):
            until = self._bounds[i + 1][0] if i + 1 < len(self._bounds) else end
            lo, hi = max(at, start), min(until, end)
            if lo < hi:
                parts[part].append(text[lo - start : hi - start])
        self._offset = end
        # bounds wholly behind the text seen are done with (the last one still holds)
        while len(self._bounds) > 1 and self._bounds[1][0] <= end:
            self._bounds.pop(0)
        return "".join(parts["reasoning"]), "".join(parts["content"])
