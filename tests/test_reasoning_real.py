"""A reasoning model through a real disaggregated deployment: a random Qwen3 with Qwen3's
chat template, steered through the thinking markers by its weights
(tests/reasoning_model.py: ``<think>Let me see</think>\\n\\nBlue!``), read by the openai
SDK (``message.reasoning``, ``delta.reasoning`` as extra fields) and LangChain's
ChatOpenAI (the answer without the thinking); a JSON schema and a forced tool call held
by xgrammar after the thinking."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pdserve.cli.deployment import Deployment
from tests.e2e import deployment
from tests.reasoning_model import ANSWER, THINKING, steered_qwen3

pytestmark = pytest.mark.slow
openai = pytest.importorskip("openai")

ASK = [{"role": "user", "content": "What colour is the sky?"}]
NUM_THINKING = 5  # <think> Let " me" " see" </think>


@pytest.fixture(scope="module")
def dep(tmp_path_factory: pytest.TempPathFactory, real_model_dir: Path) -> Iterator[Deployment]:
    model = steered_qwen3(tmp_path_factory.mktemp("qwen3") / "steered", real_model_dir)
    with deployment(tmp_path_factory.mktemp("dep"), model, engine={"max_model_len": 1024},
                    served_model_name=["qwen3"]) as d:  # fmt: skip
        yield d


@pytest.fixture(scope="module")
def client(dep: Deployment) -> Any:
    return openai.OpenAI(base_url=f"{dep.url}/v1", api_key="x", max_retries=0, timeout=120)


def ask(client: Any, stream: bool, **kwargs: Any) -> tuple[str | None, str | None, str, Any]:
    """(reasoning, content, finish reason, usage), read off the body or assembled from the
    stream's deltas as a client does."""
    body = {"model": "qwen3", "messages": ASK, "temperature": 0, **kwargs}
    if not stream:
        response = client.chat.completions.create(**body)
        choice = response.choices[0]
        message = choice.message
        assert message.reasoning == message.reasoning_content
        return message.reasoning, message.content, choice.finish_reason, response.usage
    thought, answer, reason, usage = None, None, "", None
    for chunk in client.chat.completions.create(**body, stream=True,
                                                stream_options={"include_usage": True}):  # fmt: skip
        usage = chunk.usage or usage
        for choice in chunk.choices:
            delta = choice.delta
            if getattr(delta, "reasoning", None):
                assert delta.reasoning == delta.reasoning_content
                thought = (thought or "") + delta.reasoning
            if delta.content:
                answer = (answer or "") + delta.content
            reason = choice.finish_reason or reason
    return thought, answer, reason, usage


@pytest.mark.parametrize("stream", [False, True], ids=["body", "stream"])
def test_thinking_and_answer(client: Any, stream: bool) -> None:
    thought, answer, reason, usage = ask(client, stream)
    assert (thought, answer, reason) == (THINKING, ANSWER, "stop")
    assert usage.completion_tokens_details.reasoning_tokens == NUM_THINKING
    # cut while thinking: all of it is thinking
    thought, answer, reason, usage = ask(client, stream, max_tokens=3)
    assert (thought, answer or "", reason) == ("Let me", "", "length")
    assert usage.completion_tokens_details.reasoning_tokens == 3
    # the template turned thinking off: the model answers at once, no reasoning
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    thought, answer, reason, usage = ask(client, stream, extra_body=off)
    assert (thought, answer, reason) == (None, "Blue!", "stop")
    assert usage.completion_tokens_details.reasoning_tokens == 0


def test_json_schema_and_tool_call_after_the_thinking(client: Any) -> None:
    pytest.importorskip("xgrammar")
    colour = {"type": "object", "properties": {"colour": {"enum": ["blue", "grey"]}},
              "required": ["colour"], "additionalProperties": False}  # fmt: skip
    schema = {"type": "json_schema", "json_schema": {"name": "sky", "schema": colour}}
    for stream in (False, True):
        thought, answer, reason, _ = ask(client, stream, response_format=schema, max_tokens=40)
        assert thought == THINKING and reason == "stop"
        assert json.loads(answer or "")["colour"] in ("blue", "grey")
    city = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}},
            "required": ["city"], "additionalProperties": False}  # fmt: skip
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": city}}]
    response = client.chat.completions.create(
        model="qwen3", messages=ASK, temperature=0, tools=tools, tool_choice="required",
        parallel_tool_calls=False, max_tokens=60,
    )  # fmt: skip
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.reasoning == THINKING
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments)["city"] in ("Paris", "Rome")


def test_langchain_gets_the_answer_without_the_thinking(dep: Deployment) -> None:
    langchain_openai = pytest.importorskip("langchain_openai")
    llm = langchain_openai.ChatOpenAI(base_url=f"{dep.url}/v1", api_key="x", model="qwen3",
                                      temperature=0, max_retries=0, timeout=120)  # fmt: skip
    assert llm.invoke(ASK).content == ANSWER
    assert "".join(str(chunk.content) for chunk in llm.stream(ASK)) == ANSWER


def test_reasoning_sent_back_reaches_the_template(dep: Deployment, client: Any) -> None:
    """Interleaved thinking: the previous turn's reasoning, sent back, is in the prompt
    as transformers renders it (/tokenize counts what a chat completion sees)."""
    import httpx

    transformers = pytest.importorskip("transformers")
    call = {"id": "c1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}  # fmt: skip
    turns = [*ASK, {"role": "assistant", "content": "", "tool_calls": [call],
                    "reasoning": "I should look it up."},
             {"role": "tool", "tool_call_id": "c1", "content": "blue"}]  # fmt: skip
    got = httpx.post(f"{dep.url}/tokenize", json={"messages": turns}, timeout=30).json()
    hf = transformers.AutoTokenizer.from_pretrained(dep.cfg.model)
    want = [{k: v for k, v in m.items() if k != "reasoning"} for m in turns]
    want[1]["reasoning_content"] = "I should look it up."
    text = hf.apply_chat_template(want, tokenize=False, add_generation_prompt=True)
    assert "<think>\nI should look it up.\n</think>" in text
    assert got["tokens"] == hf(text, add_special_tokens=False)["input_ids"]
    # and the model, after it, thinks and answers again
    thought, answer, _, _ = ask(client, False, messages=turns)
    assert (thought, answer) == (THINKING, ANSWER)
