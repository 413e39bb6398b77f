"""Requests' prompts as token ids: completions' four prompt shapes and their echoes, chat
messages through the model's chat template (tools and tool messages included), and the
/tokenize and /detokenize answers. Run on the loop or, for long bodies, in the tokenize
pool (so errors pickle: ApiError)."""

from __future__ import annotations

import re
import secrets
from typing import Any

from pdserve.common.errors import PdserveError
from pdserve.common.model.checkpoint.tokenizer import SPECIAL_TOKEN_NAMES
from pdserve.services.router import openai_schema as oa
from pdserve.services.router.core_api import RouterCore
from pdserve.services.router.http_errors import ApiError
from pdserve.services.router.reasoning import template_reads, template_reads_key
from pdserve.services.router.tool_calls import ToolError, functions_of, template_messages


def completion_prompts(core: RouterCore, prompt: str | list[Any]) -> list[list[int]]:
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


def completion_echoes(core: RouterCore, prompt: str | list[Any],
                       prompts: list[list[int]]) -> list[str]:  # fmt: skip
    """echo: each prompt's text as given, or its token ids decoded."""
    if isinstance(prompt, str):
        return [prompt]
    if all(isinstance(p, str) for p in prompt):
        return list(prompt)
    return [core.tokenizer.decode(ids) for ids in prompts]


def content_text(content: str | list[oa.ContentPart] | None, index: int = 0) -> str:
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


def chat_prompt(core: RouterCore, req: oa.ChatCompletionRequest,
                special_in_content: bool = True) -> list[int]:  # fmt: skip
    """The rendered messages' ids. ``special_in_content`` False
    (``special_tokens_in_content = false``): a special token's text inside a message's
    content (``<|im_start|>system``) is tokenised as the plain text it is, not as the
    control token, so a client cannot write roles into the template's structure."""
    plain = None if special_in_content else PlainContents()
    return _encode(core, _render(core, req, req.wants_generation_prompt, plain), plain)


def chat_prompt_and_tail(core: RouterCore, req: oa.ChatCompletionRequest,
                         special_in_content: bool = True,
                         ) -> tuple[list[int], list[int] | None]:  # fmt: skip
    """The prompt and the ids of the generation prompt the template added after the
    messages (None without one), where a reasoning model's thinking may already open
    or close (reasoning.py)."""
    plain = None if special_in_content else PlainContents()
    text = _render(core, req, req.wants_generation_prompt, plain)
    ids = _encode(core, text, plain)
    if not req.wants_generation_prompt:
        return ids, None
    head = _render(core, req, False, plain and PlainContents(plain.nonce))
    if not text.startswith(head):  # a template that renders the messages otherwise
        return ids, None
    return ids, core.tokenizer.encode(text[len(head) :], add_special_tokens=False)


class PlainContents:
    """The message contents to tokenise as plain text: each stands in the template as a
    placeholder (private-use characters around a random nonce, which no client can
    guess, and an index), and the rendered text is cut at them."""

    def __init__(self, nonce: str | None = None) -> None:
        self.nonce = nonce or secrets.token_hex(8)
        self.contents: dict[str, str] = {}
        self.pattern = re.compile(f"(\ue000{self.nonce}:[0-9]+\ue001)")

    def stand_in(self, content: str) -> str:
        key = f"\ue000{self.nonce}:{len(self.contents)}\ue001"
        self.contents[key] = content
        return key


def _encode(core: RouterCore, text: str, plain: PlainContents | None = None) -> list[int]:
    # The template already wrote BOS and friends as text; adding them again would double them.
    if plain is None or not plain.contents:
        ids = core.tokenizer.encode(text, add_special_tokens=False)
    else:
        ids = []
        left = dict(plain.contents)
        for i, part in enumerate(plain.pattern.split(text)):
            if i % 2 == 0:  # the template's own text: its special tokens are control tokens
                ids += core.tokenizer.encode(part, add_special_tokens=False) if part else []
            elif part in left:
                ids += core.tokenizer.encode_plain(left.pop(part))
            else:  # a content the template repeated: plain text again
                ids += core.tokenizer.encode_plain(plain.contents[part])
        if left:  # the template dropped or rewrote a content it was given
            raise ApiError(400, "a message's content holds the text of a special token, which "
                           "this server takes as plain text (special_tokens_in_content = "
                           "false), and this model's chat template rewrites the content, so "
                           "it cannot be kept apart; remove the special token's text",
                           param="messages", code="invalid_value")  # fmt: skip
    if not ids:
        raise ApiError(
            400, "the messages render to an empty prompt", param="messages", code="invalid_value"
        )
    return ids


def _plain_contents(core: RouterCore, chat: list[dict[str, Any]], plain: PlainContents) -> None:
    """Each content of ``chat`` holding a special token's text replaced by its stand-in."""
    specials = core.tokenizer.special_token_texts
    for message in chat:
        content = message.get("content")
        if isinstance(content, str) and any(t in content for t in specials):
            message["content"] = plain.stand_in(content)


def _render(core: RouterCore, req: oa.ChatCompletionRequest, generation_prompt: bool,
            plain: PlainContents | None = None) -> str:  # fmt: skip
    """``plain``: given, the contents holding a special token's text stand in the text
    as placeholders, which it maps back to them (``_encode`` tokenises them as text)."""
    template = core.tokenizer.chat_template
    chat = template_messages([_message(m, i, template) for i, m in enumerate(req.messages)])
    if plain is not None:
        _plain_contents(core, chat, plain)
    kwargs = dict(req.chat_template_kwargs or {})
    reserved = sorted(_RESERVED_TEMPLATE_VARS & set(kwargs))
    if reserved:
        raise ApiError(400, f"chat_template_kwargs cannot set {', '.join(reserved)}; use the "
                       "request's own fields", param="chat_template_kwargs",
                       code="invalid_value")  # fmt: skip
    if template is not None:
        _check_template_kwargs(kwargs, core.tokenizer.template_variables)
    if req.reasoning_effort is not None:
        if not template_reads(template, "reasoning_effort"):
            raise ApiError(400, "reasoning_effort: this model's chat template has no notion of "
                           "reasoning effort (docs/api.md lists the models that take it); "
                           "leave it out", param="reasoning_effort",
                           code="unsupported_parameter")  # fmt: skip
        if kwargs.get("reasoning_effort", req.reasoning_effort) != req.reasoning_effort:
            raise ApiError(400, "reasoning_effort and chat_template_kwargs.reasoning_effort "
                           "differ; send one of them", param="reasoning_effort",
                           code="invalid_value")  # fmt: skip
        kwargs["reasoning_effort"] = req.reasoning_effort
    try:
        text = core.tokenizer.apply_chat_template(chat, generation_prompt, kwargs,
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
    return text


def _check_template_kwargs(kwargs: dict[str, Any], read: frozenset[str]) -> None:
    """No kwarg is silently ignored: one naming a special token (the template gets the
    model's own) or one the template never reads (vLLM drops it) is a 400 naming it."""
    special = sorted(set(SPECIAL_TOKEN_NAMES) & set(kwargs))
    if special:
        raise ApiError(400, f"chat_template_kwargs cannot set {', '.join(special)}: the "
                       "template is given the model's own special tokens",
                       param=f"chat_template_kwargs.{special[0]}",
                       code="invalid_value")  # fmt: skip
    unread = sorted(set(kwargs) - read)
    if unread:
        own = sorted(read - _RESERVED_TEMPLATE_VARS - set(SPECIAL_TOKEN_NAMES))
        reads = (
            f"the variables it reads: {', '.join(own)}"
            if own
            else "it reads no variables of its own"
        )
        names = ", ".join(unread)
        raise ApiError(400, f"chat_template_kwargs: this model's chat template does not read "
                       f"{names}, so {'they' if len(unread) > 1 else 'it'} would be ignored "
                       f"({reads}); leave {'them' if len(unread) > 1 else 'it'} out",
                       param=f"chat_template_kwargs.{unread[0]}",
                       code="unsupported_parameter")  # fmt: skip


def _message(message: oa.ChatMessageIn, index: int, template: str | None) -> dict[str, Any]:
    out = {"role": message.role, "content": content_text(message.content, index),
           "name": message.name, "tool_calls": message.tool_calls,
           "tool_call_id": message.tool_call_id}  # fmt: skip
    thinking = message.thinking
    if thinking is not None:
        if not (template_reads_key(template, "reasoning_content")
                or template_reads_key(template, "reasoning")):  # fmt: skip
            name = "reasoning" if message.reasoning is not None else "reasoning_content"
            raise ApiError(400, f"messages[{index}].{name}: this model's chat template does "
                           "not render an assistant's reasoning, so it would be dropped; "
                           "leave it out", param=f"messages[{index}].{name}",
                           code="unsupported_parameter")  # fmt: skip
        # under both names: templates read one or the other (Qwen3: reasoning_content)
        out["reasoning_content"] = out["reasoning"] = thinking
    return out


def tokenize_answer(core: RouterCore, req: oa.TokenizeRequest,
                    special_in_content: bool = True) -> tuple[list[int], list[str]]:  # fmt: skip
    """/tokenize: the ids of the prompt or the rendered messages, and each id's text when
    asked for (``return_token_strs``; else an empty list)."""
    tokenizer = core.tokenizer
    if req.prompt is not None:
        if req.tools:
            raise ApiError(400, "tools are rendered by the chat template; give messages, not "
                           "a prompt", param="tools", code="invalid_value")  # fmt: skip
        add_special = True if req.add_special_tokens is None else req.add_special_tokens
        ids = tokenizer.encode(req.prompt, add_special_tokens=add_special)
    else:
        try:
            functions_of(req.tools or [])
        except ToolError as exc:
            raise ApiError(400, str(exc), param=exc.param, code="invalid_value") from None
        refused = oa.reasoning_unsupported(req.messages or [])
        if refused is not None:
            raise ApiError(400, refused[1], param=refused[0], code="invalid_value")
        chat = oa.ChatCompletionRequest(
            messages=req.messages or [], add_generation_prompt=req.add_generation_prompt,
            continue_final_message=req.continue_final_message,
            chat_template_kwargs=req.chat_template_kwargs, tools=req.tools,
        )  # fmt: skip
        ids = chat_prompt(core, chat, special_in_content)
        if req.add_special_tokens and tokenizer.bos_token_id is not None:
            ids = [tokenizer.bos_token_id, *ids]
    if not req.return_token_strs:
        return ids, []
    return ids, [tokenizer.decode([t], skip_special_tokens=False) for t in ids]


def detokenize_answer(core: RouterCore, tokens: list[int]) -> str:
    return core.tokenizer.decode(tokens)
