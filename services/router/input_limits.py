"""What the router refuses before it tokenises anything (issue 19, "the router loop never
blocks"): a text with more characters than ``max_model_len`` tokens could ever cover, more
prompts in one request than ``max_prompts_per_request``. Counting characters is linear and
cheap; tokenising a 10 MB body was seconds of a held GIL."""

from __future__ import annotations

from typing import Any

import msgspec

MAX_DEPTH = 8


def text_chars(value: Any, depth: int = 0) -> int:
    """Characters of every string inside ``value`` (strings, lists, dicts, msgspec Structs)."""
    if isinstance(value, str):
        return len(value)
    if depth >= MAX_DEPTH:
        return 0
    if isinstance(value, list | tuple):
        return sum(text_chars(v, depth + 1) for v in value)
    if isinstance(value, dict):
        return sum(text_chars(v, depth + 1) for v in value.values())
    if isinstance(value, msgspec.Struct):
        return sum(text_chars(getattr(value, f), depth + 1) for f in value.__struct_fields__)
    return 0


def num_prompts(prompt: Any) -> int:
    """How many prompts a /v1/completions ``prompt`` holds (OpenAI's four shapes)."""
    if isinstance(prompt, list) and prompt and not all(isinstance(p, int) for p in prompt):
        return len(prompt)
    return 1


# How deep JSON may nest inside a request's free-form fields (tools, response_format,
# guided_json, chat_template_kwargs, ...). Whatever walks such a value recursively (JSON
# encoding, pickling to the tokenizer process, the chat template, xgrammar's compiler,
# whose time grows steeply with a schema's depth) meets it bounded: a body nested deeper
# is a 400 naming this limit before any of them runs. 64 levels hold a tool schema
# ~30 properties deep (each property is two levels: "properties", then its name).
MAX_JSON_DEPTH = 64


def too_deep(value: Any, limit: int = MAX_JSON_DEPTH) -> str | None:
    """The path (``tools[0].function.parameters...``) of the first list or object of
    ``value`` (a decoded request: Structs, lists, dicts) inside more than ``limit`` lists
    and objects (itself counted; a typed Struct counts none); None when none is.
    Iterative: no recursion for a hostile depth to exhaust."""
    stack: list[tuple[Any, int, str]] = [(value, 0, "")]
    while stack:
        item, depth, path = stack.pop()
        if isinstance(item, msgspec.Struct):
            pairs: Any = ((name, getattr(item, name)) for name in item.__struct_fields__)
            prefix = f"{path}." if path else ""
        elif depth > limit:
            return path
        elif isinstance(item, dict):
            pairs, prefix = item.items(), f"{path}."
        else:
            pairs, prefix = enumerate(item), path
        for key, child in pairs:
            if isinstance(child, list | dict | msgspec.Struct):
                name = f"{prefix}{key}" if isinstance(key, str) else f"{path}[{key}]"
                stack.append((child, depth + (not isinstance(child, msgspec.Struct)), name))
    return None
