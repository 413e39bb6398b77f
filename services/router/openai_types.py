"""The field types of the OpenAI-compatible bodies (ranges as OpenAI states them) and the
strict decoding every request goes through: a wrong type or an out-of-range value is a
400 whose message names the field (msgspec says "... - at `$.max_tokens`")."""

from __future__ import annotations

from typing import Annotated, Any, Literal, TypeVar

import msgspec
from msgspec import Meta

from pdserve.common.engine.sampling_params import MAX_LOGPROBS

T = TypeVar("T")

TokenId = Annotated[int, Meta(ge=0)]
NonNegative = Annotated[int, Meta(ge=0)]
Text = Annotated[str, Meta(min_length=1)]


def only(schema: dict[str, Any]) -> Meta:
    """A field this server takes only at its default: the schema says so (fuzzers then
    send what is supported), the handler refuses other values with a clear message."""
    return Meta(extra_json_schema=schema, description="not supported beyond this value")


Count = Annotated[int, Meta(ge=1)]
# n and best_of: OpenAI's own limit. Each choice is a request of its own, so an unbounded
# count would let one body fill the router (and the server's memory) with copies.
MAX_CHOICES = 128
Choices = Annotated[int, Meta(ge=1, le=MAX_CHOICES)]
Seed = Annotated[int, Meta(ge=-(2**63), le=2**63 - 1)]  # what torch's manual_seed takes
# msgspec can only hold one array type in a union, so the decoded type is looser
# (a list of str | int | list[int]) and the handler checks the list is homogeneous;
# the OpenAPI document (openapi.py) states the four shapes OpenAI accepts.
Prompt = Text | Annotated[list[Text | TokenId | Annotated[list[TokenId], Meta(min_length=1)]],
                          Meta(min_length=1)]  # fmt: skip


def _integral_floats_as_ints(value: Any) -> Any:
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, list):
        return [_integral_floats_as_ints(v) for v in value]
    if isinstance(value, dict):
        return {k: _integral_floats_as_ints(v) for k, v in value.items()}
    return value


def decode_request(body: bytes, kind: type[T]) -> T:
    """Strict decoding, raising msgspec's DecodeError / ValidationError (which name the
    field), except that an integral float is taken for an int."""
    try:
        return _decode_request(body, kind)
    except RecursionError:  # [[[[...]]]] anywhere, even in a field that is skipped
        raise msgspec.DecodeError("the JSON is nested too deeply") from None


def _decode_request(body: bytes, kind: type[T]) -> T:
    try:
        return msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as exc:
        if "got `float`" not in str(exc):
            raise
    # JSON has one number type, and JSON Schema counts 16.0 as an integer: accept it, but
    # nothing looser (no "16" strings). A slow path, taken only for such bodies.
    return msgspec.convert(_integral_floats_as_ints(msgspec.json.decode(body)), kind)


class StreamOptions(msgspec.Struct, kw_only=True):
    include_usage: bool | None = False


class ResponseFormat(msgspec.Struct, kw_only=True):
    type: str = "text"  # text | json_object | json_schema (structured_request.py)
    json_schema: Any = None  # {"name", "schema", "strict"}


Temperature = Annotated[float, Meta(ge=0.0, le=2.0)]  # OpenAI's range
Penalty = Annotated[float, Meta(ge=-2.0, le=2.0)]  # OpenAI's range
Bias = Annotated[float, Meta(ge=-100.0, le=100.0)]
NumLogprobs = Annotated[int, Meta(ge=0, le=MAX_LOGPROBS)]
NullableAny = Annotated[Any, only({"type": "null"})]
# OpenAI's values; handed to the chat template, for the templates that read it
ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh"]
