"""The structured-output fields of a request (OpenAI's and vLLM's) as one constraint.

OpenAI: ``response_format`` ``json_object`` / ``json_schema``. vLLM: ``guided_json``,
``guided_regex``, ``guided_choice``, ``guided_grammar``, and ``structured_outputs``
(``json``, ``regex``, ``choice``, ``grammar``, ``json_object``). At most one may be set;
prefill and decode compile and apply it (common/engine/structured.py).
"""

from __future__ import annotations

import json
from typing import Any

from pdserve.common.engine.sampling_params import StructuredOutput

BACKENDS = (None, "auto", "xgrammar")


class StructuredError(ValueError):
    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


def structured_of(req: Any) -> StructuredOutput | None:
    """The one constraint ``req`` asks for (None: none); StructuredError names the field."""
    found: list[tuple[str, StructuredOutput]] = []
    response_format = getattr(req, "response_format", None)
    if response_format is not None and response_format.type != "text":
        found.append(("response_format", _response_format(response_format)))
    for field, kind in (("guided_json", "json"), ("guided_regex", "regex"),
                        ("guided_choice", "choice"), ("guided_grammar", "grammar")):  # fmt: skip
        value = getattr(req, field)
        if value is not None:
            found.append((field, _spec(field, kind, value)))
    if req.structured_outputs is not None:
        found.append(("structured_outputs", _structured_outputs(req.structured_outputs)))
    if req.guided_decoding_backend not in BACKENDS:
        raise StructuredError("guided_decoding_backend",
                              f"guided_decoding_backend {req.guided_decoding_backend!r}: this "
                              "server uses xgrammar ('auto' or 'xgrammar')")  # fmt: skip
    if len(found) > 1:
        names = ", ".join(name for name, _ in found)
        raise StructuredError(found[1][0], f"give one structured output constraint, got {names}")
    return found[0][1] if found else None


def _response_format(rf: Any) -> StructuredOutput:
    if rf.type == "json_object":
        return StructuredOutput(kind="json_object")
    if rf.type == "json_schema":
        schema = rf.json_schema.get("schema") if isinstance(rf.json_schema, dict) else None
        if not isinstance(schema, dict):
            raise StructuredError("response_format", "response_format json_schema needs "
                                  "json_schema.schema, a JSON schema object")  # fmt: skip
        return StructuredOutput(kind="json", spec=json.dumps(schema))
    raise StructuredError("response_format", f"response_format type {rf.type!r} is not one of "
                          "'text', 'json_object', 'json_schema'")  # fmt: skip


def _spec(field: str, kind: str, value: Any) -> StructuredOutput:
    if kind == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError:
                raise StructuredError(field, f"{field} is not valid JSON") from None
        if not isinstance(value, dict | bool):
            raise StructuredError(field, f"{field} must be a JSON schema (an object)")
        return StructuredOutput(kind="json", spec=json.dumps(value))
    if kind == "choice":
        if not (isinstance(value, list) and value and all(isinstance(c, str) for c in value)):
            raise StructuredError(field, f"{field} must be a non-empty list of strings")
        return StructuredOutput(kind="choice", spec=json.dumps(value))
    if not isinstance(value, str) or not value:
        raise StructuredError(field, f"{field} must be a non-empty string")
    return StructuredOutput(kind=kind, spec=value)


def _structured_outputs(value: Any) -> StructuredOutput:
    field = "structured_outputs"
    if not isinstance(value, dict):
        raise StructuredError(field, f"{field} must be an object")
    given = {k: v for k, v in value.items() if v is not None and v is not False}
    known = {"json": "json", "regex": "regex", "choice": "choice", "grammar": "grammar"}
    if given.keys() == {"json_object"}:
        return StructuredOutput(kind="json_object")
    if len(given) != 1 or next(iter(given)) not in known:
        raise StructuredError(field, f"{field} takes exactly one of json, regex, choice, "
                              f"grammar, json_object; got {sorted(given)}")  # fmt: skip
    key, spec = next(iter(given.items()))
    return _spec(f"{field}.{key}", known[key], spec)
