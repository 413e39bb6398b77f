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
