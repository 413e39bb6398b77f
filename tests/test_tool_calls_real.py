"""Tool calls from the embedded model through a real disaggregated deployment: with
tool_choice required or a named function, xgrammar holds the output to a call, so even a
135M model answers one that parses, streamed or not."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pdserve.cli.deployment import Deployment
from tests.e2e import deployment
from tests.test_tool_calls import TOOLS

pytestmark = pytest.mark.slow
openai = pytest.importorskip("openai")
pytest.importorskip("xgrammar")

ASK = [{"role": "user", "content": "What is the weather in Paris, in Celsius?"}]


@pytest.fixture(scope="module")
def dep(tmp_path_factory: pytest.TempPathFactory, real_model_dir: Path) -> Iterator[Deployment]:
    with deployment(tmp_path_factory.mktemp("dep"), real_model_dir,
                    engine={"max_model_len": 1024}) as d:  # fmt: skip
        yield d


def calls_of(client: Any, stream: bool, **kwargs: Any) -> tuple[list[tuple[str, Any]], str]:
    """[(name, arguments)] and the finish reason, assembled from a stream's deltas or read
    off the body."""
    body = {"model": client.models.list().data[0].id, "messages": ASK, "tools": TOOLS,
            "max_tokens": 120, "temperature": 0, **kwargs}  # fmt: skip
    if not stream:
        choice = client.chat.completions.create(**body).choices[0]
        calls = choice.message.tool_calls or []
        return [(c.function.name, json.loads(c.function.arguments)) for c in calls], \
            choice.finish_reason  # fmt: skip
    names: dict[int, str] = {}
    args: dict[int, str] = {}
    reason = ""
    for chunk in client.chat.completions.create(**body, stream=True):
        for choice in chunk.choices:
            for delta in choice.delta.tool_calls or []:
                if delta.function.name:
                    names[delta.index] = delta.function.name
                args[delta.index] = args.get(delta.index, "") + (delta.function.arguments or "")
            reason = choice.finish_reason or reason
    return [(names[i], json.loads(args[i])) for i in sorted(names)], reason


@pytest.mark.parametrize("stream", [False, True], ids=["body", "stream"])
def test_forced_tool_calls_parse(dep: Deployment, stream: bool) -> None:
    client = openai.OpenAI(base_url=f"{dep.url}/v1", api_key="x", max_retries=0)
    named = {"type": "function", "function": {"name": "get_weather"}}
    calls, reason = calls_of(client, stream, tool_choice=named)
    assert reason == "tool_calls"
    [(name, args)] = calls
    assert name == "get_weather" and isinstance(args.get("city"), str)
    calls, reason = calls_of(client, stream, tool_choice="required", parallel_tool_calls=False)
    assert reason == "tool_calls"
    [(name, args)] = calls
    assert name in ("get_weather", "get_time") and isinstance(args, dict)
