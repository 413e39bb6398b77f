"""Tool calling: the request's tools and tool_choice, and the model's calls parsed out of
its text.

Two formats, as the templates that teach them: ``llama3_json`` (Llama 3.x: a JSON object
``{"name": ..., "parameters": {...}}``, optionally after ``<|python_tag|>``, several
joined by ``;``) and ``hermes`` (Qwen 2.5 / 3, Hermes: ``<tool_call>{"name": ...,
"arguments": {...}}</tool_call>``, one block per call). The format is the deployment's
``tool_call_parser`` or, by default, read off the chat template.

``tool_choice``: ``none`` (tools shown to the template, nothing parsed), ``auto`` (the
text is parsed; no call found: plain content), ``required`` and a named function: the
output is constrained by xgrammar (the structured-output path) to a JSON array of calls
(``[{"name", "parameters"}]``) or to the named function's arguments, so any model, however
small, answers a call that parses.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

import msgspec

from pdserve.common.engine.sampling_params import StructuredOutput

PARSERS = ("llama3_json", "hermes")
HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


class ToolError(ValueError):
    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


class FunctionCall(msgspec.Struct, kw_only=True):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(msgspec.Struct, kw_only=True):
    id: str
    type: str = "function"
    function: FunctionCall


class DeltaFunction(msgspec.Struct, kw_only=True, omit_defaults=True):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(msgspec.Struct, kw_only=True, omit_defaults=True):
    index: int
    id: str | None = None
    type: str | None = None
    function: DeltaFunction | None = None


class ToolMode(msgspec.Struct, kw_only=True, frozen=True):
    """A request's tools: what the answer may be, and how its text is read."""

    choice: str  # none | auto | required | function:<name>
    functions: dict[str, dict[str, Any]]  # name -> parameters schema
    parallel: bool  # parallel_tool_calls: false keeps at most one call
    forced: StructuredOutput | None  # the grammar of required / a named function

    @property
    def parses(self) -> bool:
        return self.choice != "none"

    def calls(self, parser: str, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, calls) of a finished answer."""
        if not self.parses:
            return text, []
        if self.forced is not None:
            calls = parse_forced(self.choice, text, self.functions)
            return (None, calls) if calls else (text, [])
        content, calls = parse(parser, text, self.functions)
        return content, calls if self.parallel else calls[:1]


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def detect_parser(chat_template: str | None) -> str:
    """The format the model's template teaches; Llama 3's JSON when it names neither."""
    template = chat_template or ""
    if HERMES_OPEN in template:
        return "hermes"
    return "llama3_json"


def functions_of(tools: list[Any]) -> dict[str, dict[str, Any]]:
    """name -> parameters schema; ToolError names a malformed tool."""
    out: dict[str, dict[str, Any]] = {}
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if (
            not isinstance(tool, dict)
            or tool.get("type", "function") != "function"
            or (not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"])
        ):
            raise ToolError(f"tools[{i}]", f"tools[{i}] must be {{\"type\": \"function\", "
                            "\"function\": {\"name\": ..., \"parameters\": {...}}}")  # fmt: skip
        params = fn.get("parameters")
        if params is None:
            params = {"type": "object", "properties": {}}
        if not isinstance(params, dict):
            raise ToolError(f"tools[{i}]", f"tools[{i}].function.parameters must be a JSON "
                            "schema (an object)")  # fmt: skip
        if fn["name"] in out:
            raise ToolError(f"tools[{i}]", f"tools[{i}]: the function name {fn['name']!r} "
                            "appears twice")  # fmt: skip
        out[fn["name"]] = params
    return out


def choice_of(tool_choice: Any, functions: dict[str, dict[str, Any]]) -> str:
    """'none' | 'auto' | 'required' | 'function:<name>'; ToolError on anything else."""
    if tool_choice is None:
        return "auto" if functions else "none"
    if tool_choice in ("none", "auto", "required"):
        if tool_choice != "none" and not functions:
            raise ToolError("tool_choice", f"tool_choice {tool_choice!r} needs tools")
        return str(tool_choice)
    name = None
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "function":
        fn = tool_choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str):
        raise ToolError("tool_choice", "tool_choice must be 'none', 'auto', 'required' or "
                        "{\"type\": \"function\", \"function\": {\"name\": ...}}")  # fmt: skip
    if name not in functions:
        known = ", ".join(repr(n) for n in functions) or "none"
        raise ToolError("tool_choice", f"tool_choice names {name!r}, which is not among the "
                        f"tools ({known})")  # fmt: skip
    return f"function:{name}"


def constraint(choice: str, functions: dict[str, dict[str, Any]],
               parallel: bool) -> StructuredOutput | None:  # fmt: skip
    """The grammar that forces a call: the named function's arguments, or (required) a JSON
    array of calls, each ``{"name": <one of the tools>, "parameters": <its schema>}``."""
    if choice.startswith("function:"):
        return StructuredOutput(kind="json", spec=json.dumps(functions[choice[9:]]))
    if choice != "required":
        return None
    calls = [{"type": "object", "properties": {"name": {"const": name}, "parameters": params},
              "required": ["name", "parameters"], "additionalProperties": False}
             for name, params in functions.items()]  # fmt: skip
    schema: dict[str, Any] = {"type": "array", "minItems": 1,
                              "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}  # fmt: skip
    if not parallel:
        schema["maxItems"] = 1
    return StructuredOutput(kind="json", spec=json.dumps(schema))


def _call(obj: Any, functions: dict[str, dict[str, Any]]) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    if functions and obj["name"] not in functions:
        return None
    args = obj.get("parameters", obj.get("arguments", {}))
    text = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
    return ToolCall(id=call_id(), function=FunctionCall(name=obj["name"], arguments=text))


def _json_objects(text: str) -> list[Any] | None:
    """``text`` as one or more JSON values joined by ``;`` or whitespace; None otherwise."""
    decoder = json.JSONDecoder()
    out: list[Any] = []
    at = 0
    while True:
        while at < len(text) and (text[at].isspace() or text[at] == ";"):
            at += 1
        if at == len(text):
            return out
        try:
            value, at = decoder.raw_decode(text, at)
        except ValueError:
            return None
        out.append(value)


def parse(parser: str, text: str,
          functions: dict[str, dict[str, Any]]) -> tuple[str | None, list[ToolCall]]:  # fmt: skip
    """(content, calls) of a model's text; no call found: (text, [])."""
    if parser == "hermes":
        at = text.find(HERMES_OPEN)
        if at < 0:
            return text, []
        calls = []
        for body in _HERMES.findall(text[at:]):
            try:
                call = _call(json.loads(body), functions)
            except ValueError:
                return text, []
            if call is None:
                return text, []
            calls.append(call)
        content = text[:at].strip()
        return content or None, calls
    body = text.strip()
    body = body.removeprefix(PYTHON_TAG).strip()
    if not body.startswith(("{", "[")):
        return text, []
    values = _json_objects(body)
    if values is None:
        return text, []
    objects = [v for value in values for v in (value if isinstance(value, list) else [value])]
    found = [_call(obj, functions) for obj in objects]
    calls = [c for c in found if c is not None]
    if not calls or len(calls) < len(found):
        return text, []
    return None, calls


def parse_forced(choice: str, text: str,
                 functions: dict[str, dict[str, Any]]) -> list[ToolCall]:  # fmt: skip
    """The calls of a grammar-forced answer (``constraint``); [] when it was cut short."""
    if choice.startswith("function:"):
        try:
            json.loads(text)
        except ValueError:
            return []
        return [ToolCall(id=call_id(), function=FunctionCall(name=choice[9:], arguments=text))]
    try:
        values = json.loads(text)
    except ValueError:
        return []
    calls = [_call(v, functions) for v in values] if isinstance(values, list) else []
    return [c for c in calls if c is not None]


def check_calls(calls: list[Any], param: str) -> None:
    """An assistant message's ``tool_calls`` in OpenAI's shape, or ToolError."""
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if (
            not isinstance(fn, dict)
            or not isinstance(fn.get("name"), str)
            or not isinstance(fn.get("arguments", "{}"), str | dict)
        ):
            raise ToolError(param, f"{param}.tool_calls[{j}] must be {{\"id\": ..., \"type\": "
                            "\"function\", \"function\": {\"name\": ..., \"arguments\": JSON text}}")  # fmt: skip


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Assistant tool calls as chat templates read them (transformers' convention, as vLLM
    passes them): ``function.arguments`` a mapping, not OpenAI's JSON text."""
    out = []
    for message in messages:
        calls = message.get("tool_calls")
        if calls:
            fixed = []
            for call in calls:
                fn = dict(call.get("function") or {})
                if isinstance(fn.get("arguments"), str):
                    try:
                        fn["arguments"] = json.loads(fn["arguments"])
                    except ValueError:
                        pass  # left as text: the template shows what the client sent
                fixed.append({**call, "function": fn})
            message = {**message, "tool_calls": fixed}
        out.append(message)
    return out


class ToolStream:
    """A stream's text split into content (sent as it comes) and tool calls (held back and
    parsed at the end): Llama 3's format is a call when the text starts with ``{`` (or
    the python tag); hermes' from ``<tool_call>`` on."""

    def __init__(self, parser: str, forced: bool) -> None:
        self.parser = parser
        self.forced = forced  # the grammar makes all of it a call: hold everything
        self.text = ""  # all text so far
        self.sent = 0  # characters of it sent as content
        self.holding = forced

    def feed(self, text: str) -> str:
        """The part of ``text`` (and of what was held) that is plain content."""
        self.text += text
        if self.holding:
            return ""
        if self.parser == "hermes":
            at = self.text.find(HERMES_OPEN, self.sent)
            if at >= 0:
                self.holding = True
                out, self.sent = self.text[self.sent : at], at
                return out
            # hold back a tail that could be the start of the tag
            keep = next((k for k in range(len(HERMES_OPEN) - 1, 0, -1)
                         if self.text.endswith(HERMES_OPEN[:k])), 0)  # fmt: skip
            end = len(self.text) - keep
        else:
            stripped = self.text.lstrip()
            if not stripped:
                return ""
            if stripped.startswith(("{", "[", "<")):  # "<": maybe the python tag
                if stripped.startswith(("{", "[")) or PYTHON_TAG.startswith(stripped[:14]):
                    self.holding = True
                    return ""
            end = len(self.text)
        out, self.sent = self.text[self.sent : end], max(self.sent, end)
        return out

    def held(self) -> str:
        return self.text[self.sent :]


def call_deltas(calls: list[ToolCall]) -> list[DeltaToolCall]:
    """OpenAI's stream of calls: per call, its id, type and name (arguments empty), then
    its arguments."""
    out = []
    for i, call in enumerate(calls):
        out.append(DeltaToolCall(index=i, id=call.id, type="function",
                                 function=DeltaFunction(name=call.function.name, arguments="")))  # fmt: skip
        out.append(
            DeltaToolCall(index=i, function=DeltaFunction(arguments=call.function.arguments))
        )
    return out
