"""The core's events as one endpoint's bodies and stream chunks, logprobs included.

Token strings in logprobs are each token decoded alone (special tokens kept), as vLLM
renders them; ``bytes`` are their UTF-8 bytes.
"""

from __future__ import annotations

import abc
import time
from collections.abc import Callable

import msgspec

from pdserve.common.engine.sampling_params import TokenLogprobs
from pdserve.services.router.openai_schema import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatLogprobs,
    ChatMessageOut,
    ChatTokenLogprob,
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    Delta,
    PromptLogprob,
    TopLogprob,
    UsageInfo,
)
from pdserve.services.router.reasoning import ThinkingSplit
from pdserve.services.router.tool_calls import ToolMode, ToolStream, call_deltas

TokenText = Callable[[int], str]


class PromptScored(msgspec.Struct, kw_only=True):
    """A choice's prompt with its logprobs (entry i: token i + 1's), and how to show them:
    before the completion's own (``echo`` with ``logprobs``) and/or as vLLM's field."""

    token_ids: list[int]
    logprobs: list[TokenLogprobs]
    echo: bool
    vllm_field: bool


class Renderer(abc.ABC):
    """Turns generated text into one endpoint's bodies and stream chunks."""

    def __init__(self, request_id: str, model: str, token_text: TokenText = str) -> None:
        self.request_id = request_id
        self.model = model
        self.token_text = token_text
        self.created = int(time.time())

    def start(self, index: int) -> msgspec.Struct | None:
        return None

    def split(self, index: int, token_ids: list[int], text: str) -> tuple[str, str]:
        """(thinking, answer) of a chunk of choice ``index`` (chat with a reasoning parser:
        reasoning.py); else it is all answer."""
        return "", text

    def reasoning_tokens(self) -> int | None:
        """The thinking's tokens over every choice so far; None: no reasoning parser."""
        return None

    @abc.abstractmethod
    def delta(self, index: int, text: str, logprobs: list[TokenLogprobs] = [],  # noqa: B006 - read only
              token_ids: list[int] | None = None) -> msgspec.Struct | None:  # fmt: skip
        """A stream's chunk, or None when there is nothing to send. ``token_ids``: the
        model's tokens of ``text`` (None: text that is not the model's, an echo)."""

    @abc.abstractmethod
    def finish(self, index: int, finish_reason: str) -> msgspec.Struct: ...

    def finish_chunks(self, index: int, finish_reason: str) -> list[msgspec.Struct]:
        """What a stream sends when choice ``index`` ends (chat: held tool calls first)."""
        return [self.finish(index, finish_reason)]

    @abc.abstractmethod
    def usage_chunk(self, usage: UsageInfo) -> msgspec.Struct: ...

    @abc.abstractmethod
    def body(self, texts: list[str], reasons: list[str], usage: UsageInfo,
             logprobs: list[list[TokenLogprobs]], echoes: list[str],
             prompts: list[PromptScored | None] | None = None,
             thoughts: list[str] | None = None) -> msgspec.Struct:  # fmt: skip
        """``texts``: each choice's answer; ``thoughts``: its thinking (``split``)."""

    def prompt_delta(self, index: int, text: str, prompt: PromptScored) -> msgspec.Struct:
        """The echoed prompt of a stream, with its logprobs (completions only)."""
        raise NotImplementedError


class CompletionRenderer(Renderer):
    def __init__(self, request_id: str, model: str, token_text: TokenText = str) -> None:
        super().__init__(request_id, model, token_text)
        self._offsets: dict[int, int] = {}  # per choice: characters of text sent so far

    def _chunk(self, choices: list[CompletionChoice], usage: UsageInfo | None = None) -> Completion:
        return Completion(id=self.request_id, object="text_completion", created=self.created,
                          model=self.model, choices=choices, usage=usage)  # fmt: skip

    def _logprobs(self, index: int, text: str,
                  logprobs: list[TokenLogprobs]) -> CompletionLogprobs | None:  # fmt: skip
        offset = self._offsets.get(index, 0)
        self._offsets[index] = offset + len(text)
        if not logprobs:
            return None
        out = CompletionLogprobs(tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[])
        for lp in logprobs:
            token = self.token_text(lp.token_id)
            top = {self.token_text(t): v for t, v in zip(lp.top_ids, lp.top_logprobs, strict=True)}
            top.setdefault(token, lp.logprob)  # OpenAI: the chosen token is always there
            out.tokens.append(token)
            out.token_logprobs.append(lp.logprob)
            out.top_logprobs.append(top)
            out.text_offset.append(offset)
            offset += len(token)
        return out

    def _prompt_parts(self, prompt: PromptScored) -> tuple[CompletionLogprobs | None,
                                                           list[dict[str, PromptLogprob] | None] | None]:  # fmt: skip
        """OpenAI's legacy logprobs of the echoed prompt (the first token has none), and
        vLLM's prompt_logprobs."""
        legacy: CompletionLogprobs | None = None
        vllm: list[dict[str, PromptLogprob] | None] | None = None
        first = self.token_text(prompt.token_ids[0])
        if prompt.echo:
            legacy = CompletionLogprobs(tokens=[first], token_logprobs=[None],
                                        top_logprobs=[None], text_offset=[0])  # fmt: skip
            offset = len(first)
            for lp in prompt.logprobs:
                token = self.token_text(lp.token_id)
                top = {self.token_text(t): v for t, v in zip(lp.top_ids, lp.top_logprobs,
                                                               strict=True)}  # fmt: skip
                top.setdefault(token, lp.logprob)
                legacy.tokens.append(token)
                legacy.token_logprobs.append(lp.logprob)
                legacy.top_logprobs.append(top)
                legacy.text_offset.append(offset)
                offset += len(token)
        if prompt.vllm_field:
            vllm = [None]  # the first token has nothing before it
            for lp in prompt.logprobs:
                entries = {str(t): PromptLogprob(logprob=v, rank=r + 1,
                                                 decoded_token=self.token_text(t))
                           for r, (t, v) in enumerate(zip(lp.top_ids, lp.top_logprobs,
                                                          strict=True))}  # fmt: skip
                entries.setdefault(
                    str(lp.token_id),
                    PromptLogprob(
                        logprob=lp.logprob, rank=None, decoded_token=self.token_text(lp.token_id)
                    ),
                )
                vllm.append(entries)
        return legacy, vllm

    def prompt_delta(self, index: int, text: str, prompt: PromptScored) -> Completion:
        legacy, vllm = self._prompt_parts(prompt)
        self._offsets[index] = len(text)
        return self._chunk([CompletionChoice(index=index, text=text, finish_reason=None,
                                             logprobs=legacy, prompt_logprobs=vllm)])  # fmt: skip

    def delta(self, index: int, text: str, logprobs: list[TokenLogprobs] = [],  # noqa: B006 - read only
              token_ids: list[int] | None = None) -> Completion | None:  # fmt: skip
        if not text and not logprobs:  # a partial character: no empty chunk
            return None
        lps = self._logprobs(index, text, logprobs)
        return self._chunk([CompletionChoice(index=index, text=text, finish_reason=None,
                                             logprobs=lps)])  # fmt: skip

    def finish(self, index: int, finish_reason: str) -> Completion:
        return self._chunk([CompletionChoice(index=index, text="", finish_reason=finish_reason)])

    def usage_chunk(self, usage: UsageInfo) -> Completion:
        return self._chunk([], usage)

    def body(self, texts: list[str], reasons: list[str], usage: UsageInfo,
             logprobs: list[list[TokenLogprobs]], echoes: list[str],
             prompts: list[PromptScored | None] | None = None,
             thoughts: list[str] | None = None) -> Completion:  # fmt: skip
        choices = []
        for i, (text, reason) in enumerate(zip(texts, reasons, strict=True)):
            self._offsets[i] = len(echoes[i]) if echoes else 0
            lps = self._logprobs(i, "", logprobs[i])
            prompt = prompts[i] if prompts else None
            legacy, vllm = self._prompt_parts(prompt) if prompt is not None else (None, None)
            if legacy is not None:  # the echoed prompt's tokens come first
                gen = lps or CompletionLogprobs(tokens=[], token_logprobs=[], top_logprobs=[],
                                                text_offset=[])  # fmt: skip
                lps = CompletionLogprobs(
                    tokens=legacy.tokens + gen.tokens,
                    token_logprobs=legacy.token_logprobs + gen.token_logprobs,
                    top_logprobs=legacy.top_logprobs + gen.top_logprobs,
                    text_offset=legacy.text_offset + gen.text_offset,
                )
            choices.append(CompletionChoice(index=i, text=text, finish_reason=reason,
                                            logprobs=lps, prompt_logprobs=vllm))  # fmt: skip
        return self._chunk(choices, usage)


class ChatRenderer(Renderer):
    def __init__(self, request_id: str, model: str, token_text: TokenText = str,
                 tools: ToolMode | None = None, parser: str = "llama3_json",
                 thinking: Callable[[], ThinkingSplit] | None = None) -> None:  # fmt: skip
        """``tools``: the request's (tool_calls.py), whose calls are parsed out of the
        answer in ``parser``'s format. ``thinking``: a reasoning model's splitter of one
        choice's output (reasoning.py); the tool calls are read from the answer only."""
        super().__init__(request_id, model, token_text)
        self.tools = tools if tools is not None and tools.parses else None
        self.parser = parser
        self.thinking = thinking
        self._streams: dict[int, ToolStream] = {}
        self._held_logprobs: dict[int, list[TokenLogprobs]] = {}
        self._splits: dict[int, ThinkingSplit] = {}

    def split(self, index: int, token_ids: list[int], text: str) -> tuple[str, str]:
        if self.thinking is None:
            return "", text
        split = self._splits.get(index)
        if split is None:
            split = self._splits[index] = self.thinking()
        return split.feed(token_ids, text)

    def reasoning_tokens(self) -> int | None:
        if self.thinking is None:
            return None
        return sum(split.num_reasoning_tokens for split in self._splits.values())

    def _chunk(self, choices: list[ChatChunkChoice],
               usage: UsageInfo | None = None) -> ChatCompletionChunk:  # fmt: skip
        return ChatCompletionChunk(id=self.request_id, object="chat.completion.chunk",
                                   created=self.created, model=self.model, choices=choices,
                                   usage=usage)  # fmt: skip

    def _entry(self, token_id: int, logprob: float) -> TopLogprob:
        token = self.token_text(token_id)
        return TopLogprob(token=token, logprob=logprob, bytes=list(token.encode()))

    def _logprobs(self, logprobs: list[TokenLogprobs]) -> ChatLogprobs | None:
        if not logprobs:
            return None
        content = []
        for lp in logprobs:
            chosen = self._entry(lp.token_id, lp.logprob)
            top = [self._entry(t, v) for t, v in zip(lp.top_ids, lp.top_logprobs, strict=True)]
            content.append(ChatTokenLogprob(token=chosen.token, logprob=chosen.logprob,
                                            bytes=chosen.bytes, top_logprobs=top))  # fmt: skip
        return ChatLogprobs(content=content)

    def start(self, index: int) -> ChatCompletionChunk:
        # OpenAI's first chunk names the role; clients key their message assembly on it.
        delta = Delta(role="assistant", content="")
        return self._chunk([ChatChunkChoice(index=index, delta=delta)])

    def delta(self, index: int, text: str, logprobs: list[TokenLogprobs] = [],  # noqa: B006 - read only
              token_ids: list[int] | None = None) -> ChatCompletionChunk | None:  # fmt: skip
        thought = ""
        if token_ids is not None:
            thought, text = self.split(index, token_ids, text)
        if self.tools is not None:
            stream = self._streams.setdefault(
                index, ToolStream(self.parser, forced=self.tools.forced is not None)
            )
            text = stream.feed(text)
            if stream.holding:  # a call's tokens: their logprobs go with the call
                self._held_logprobs.setdefault(index, []).extend(logprobs)
                logprobs = []
        if not text and not thought and not logprobs:
            return None
        delta = Delta(content=text if text or not thought else None,
                      reasoning=thought or None, reasoning_content=thought or None)  # fmt: skip
        return self._chunk([ChatChunkChoice(index=index, delta=delta,
                                            logprobs=self._logprobs(logprobs))])  # fmt: skip

    def finish_chunks(self, index: int, finish_reason: str) -> list[msgspec.Struct]:
        stream = self._streams.pop(index, None)
        held = self._held_logprobs.pop(index, [])
        if self.tools is None or stream is None or not stream.held():
            return [self.finish(index, finish_reason)]
        content, calls = self.tools.calls(self.parser, stream.held())
        logprobs = self._logprobs(held)
        if not calls:  # not a call after all: the held text is content
            delta = Delta(content=stream.held())
            return [self._chunk([ChatChunkChoice(index=index, delta=delta, logprobs=logprobs)]),
                    self.finish(index, finish_reason)]  # fmt: skip
        chunks: list[msgspec.Struct] = []
        if content:
            chunks.append(self._chunk([ChatChunkChoice(index=index, delta=Delta(content=content))]))
        for i, call in enumerate(call_deltas(calls)):
            delta = Delta(tool_calls=[call])
            chunks.append(self._chunk([ChatChunkChoice(index=index, delta=delta,
                                                       logprobs=logprobs if i == 0 else None)]))  # fmt: skip
        reason = "tool_calls" if finish_reason == "stop" else finish_reason
        return [*chunks, self.finish(index, reason)]

    def finish(self, index: int, finish_reason: str) -> ChatCompletionChunk:
        choice = ChatChunkChoice(index=index, delta=Delta(), finish_reason=finish_reason)
        return self._chunk([choice])

    def usage_chunk(self, usage: UsageInfo) -> ChatCompletionChunk:
        return self._chunk([], usage)

    def body(self, texts: list[str], reasons: list[str], usage: UsageInfo,
             logprobs: list[list[TokenLogprobs]], echoes: list[str],
             prompts: list[PromptScored | None] | None = None,
             thoughts: list[str] | None = None) -> ChatCompletion:  # fmt: skip
        choices = []
        for i, (text, reason) in enumerate(zip(texts, reasons, strict=True)):
            content: str | None = text
            calls = None
            if self.tools is not None:
                content, found = self.tools.calls(self.parser, text)
                if found:
                    calls = found
                    reason = "tool_calls" if reason == "stop" else reason
            thought = (thoughts[i] if thoughts else "") or None
            message = ChatMessageOut(role="assistant", content=content, tool_calls=calls,
                                     reasoning=thought, reasoning_content=thought)  # fmt: skip
            choices.append(ChatChoice(index=i, message=message, finish_reason=reason,
                                      logprobs=self._logprobs(logprobs[i])))  # fmt: skip
        return ChatCompletion(id=self.request_id, object="chat.completion", created=self.created,
                              model=self.model, choices=choices, usage=usage)  # fmt: skip
