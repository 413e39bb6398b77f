"""Reasoning models through the HTTP API, against the fake core (whose answer is a script
of text, tokenised with a thinking tokenizer: ``<think>``/``</think>`` are single tokens)
and Qwen3's chat template: the thinking split into ``reasoning`` and
``reasoning_content``, streamed or not, the usage's reasoning tokens, the grammar's gate,
tool calls read from the answer, ``reasoning_effort``, and interleaved thinking rendered
as transformers renders it. The real model: tests/test_reasoning_real.py."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pdserve.common.model.checkpoint.tokenizer import Tokenizer
from tests.http_fakes import FakeCore, Server, error_of, request
from tests.reasoning_model import thinking_tokenizer
from tests.test_tool_calls import TOOLS

openai = pytest.importorskip("openai")

ASK = [{"role": "user", "content": "What colour is the sky?"}]
SCRIPT = "<think>\nThe sky scatters blue light.\n</think>\n\nBlue."


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> Path:
    return thinking_tokenizer(tmp_path_factory.mktemp("thinking"), model_dir)


@pytest.fixture(scope="module")
def served(tokenizer_dir: Path) -> Iterator[tuple[FakeCore, int]]:
    core = FakeCore(Tokenizer.from_dir(tokenizer_dir))
    core.max_model_len = 1024  # room for Qwen3's tool prompt
    server = Server(core, tool_call_parser="hermes")  # reasoning_parser auto: qwen3
    yield core, server.port
    server.stop()


@pytest.fixture
def core(served: tuple[FakeCore, int]) -> FakeCore:
    served[0].reset()
    served[0].script = SCRIPT
    return served[0]


@pytest.fixture
def client(served: tuple[FakeCore, int], core: FakeCore) -> Any:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{served[1]}/v1", api_key="x", max_retries=0)


def streamed(client: Any, **body: Any) -> tuple[str, str, str | None, Any, list[Any]]:
    """(reasoning, content, finish reason, usage, deltas) of a stream, as a client
    assembles them."""
    thought, answer, reason, usage, deltas = "", "", None, None, []
    for chunk in client.chat.completions.create(
        model="fake-model", stream=True, stream_options={"include_usage": True}, **body
    ):
        usage = chunk.usage or usage
        for choice in chunk.choices:
            delta = choice.delta
            if not choice.finish_reason:  # the finish chunk's delta is empty
                deltas.append(delta)
            assert getattr(delta, "reasoning", None) == getattr(delta, "reasoning_content", None)
            thought += getattr(delta, "reasoning", None) or ""
            answer += delta.content or ""
            reason = choice.finish_reason or reason
    return thought, answer, reason, usage, deltas


def test_thinking_split_from_the_answer_streamed_or_not(client: Any, core: FakeCore) -> None:
    body = client.chat.completions.create(model="fake-model", messages=ASK)
    message = body.choices[0].message
    assert message.reasoning == message.reasoning_content == "\nThe sky scatters blue light.\n"
    assert message.content == "\n\nBlue."
    thinking = len(core.tokenizer.encode(SCRIPT.split("\n\n")[0], add_special_tokens=False))
    assert body.usage.completion_tokens_details.reasoning_tokens == thinking
    thought, answer, reason, usage, deltas = streamed(client, messages=ASK)
    assert (thought, answer, reason) == (message.reasoning, message.content, "stop")
    assert usage.completion_tokens_details.reasoning_tokens == thinking
    # a delta is thinking or answer (the first: the role), never a marker, never empty
    texts = [(d.content or "") + (getattr(d, "reasoning", None) or "") for d in deltas]
    assert all(texts[1:]) and not any("think>" in t for t in texts)


def test_thinking_cut_by_max_tokens_is_all_reasoning(client: Any) -> None:
    body = client.chat.completions.create(model="fake-model", messages=ASK, max_tokens=4)
    choice = body.choices[0]
    assert choice.finish_reason == "length" and choice.message.content == ""
    assert choice.message.reasoning and "\n\n" not in choice.message.reasoning
    thought, answer, reason, _, _ = streamed(client, messages=ASK, max_tokens=4)
    assert (thought, answer, reason) == (choice.message.reasoning, "", "length")


def test_no_thinking_when_the_template_turns_it_off(client: Any, core: FakeCore) -> None:
    core.script = "Blue."
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    body = client.chat.completions.create(model="fake-model", messages=ASK, extra_body=off)
    message = body.choices[0].message
    assert (message.content, message.reasoning, message.reasoning_content) == ("Blue.", None, None)
    assert body.usage.completion_tokens_details.reasoning_tokens == 0
    # the prompt closed the thinking: a grammar holds from the first token
    schema = {"type": "json_schema", "json_schema": {"name": "c", "schema": {"type": "object"}}}
    client.chat.completions.create(model="fake-model", messages=ASK, extra_body=off,
                                   response_format=schema)  # fmt: skip
    structured = core.submitted[-1].sampling.structured
    assert structured is not None and structured.think_end_id is None
    # thinking on: it holds after the end marker, and the first token may open the thinking
    client.chat.completions.create(model="fake-model", messages=ASK, response_format=schema)
    structured = core.submitted[-1].sampling.structured
    vocab = core.tokenizer.vocab
    assert structured is not None
    assert (structured.think_end_id, structured.think_start_id) == (vocab["</think>"],
                                                                     vocab["<think>"])  # fmt: skip


def test_tool_call_after_the_thinking_parses(client: Any, core: FakeCore) -> None:
    call = {"name": "get_weather", "arguments": {"city": "Paris"}}
    core.script = (
        f"<think>\nI need the weather.\n</think>\n\n<tool_call>\n{json.dumps(call)}\n</tool_call>"
    )
    body = client.chat.completions.create(model="fake-model", messages=ASK, tools=TOOLS)
    choice = body.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.reasoning == "\nI need the weather.\n"
    [got] = choice.message.tool_calls
    assert (got.function.name, json.loads(got.function.arguments)) == ("get_weather",
                                                                        call["arguments"])  # fmt: skip
    thought, _, reason, _, deltas = streamed(client, messages=ASK, tools=TOOLS)
    assert (thought, reason) == (choice.message.reasoning, "tool_calls")
    names = [c.function.name for d in deltas for c in d.tool_calls or [] if c.function.name]
    assert names == ["get_weather"]


def test_reasoning_effort_is_refused_where_the_template_has_no_such_notion(port: int) -> None:
    body = {"messages": ASK, "reasoning_effort": "high"}
    error = error_of(*request(port, "POST", "/v1/chat/completions", body)[::2], 400)
    assert error["param"] == "reasoning_effort" and "no notion" in error["message"]
    body["reasoning_effort"] = "extreme"
    error = error_of(*request(port, "POST", "/v1/chat/completions", body)[::2], 400)
    assert "reasoning_effort" in error["message"]


def test_reasoning_effort_reaches_a_template_that_reads_it(model_dir: Path) -> None:
    from tokenizers import Tokenizer as HFTokenizer

    backend = HFTokenizer.from_file(str(model_dir / "tokenizer.json"))
    template = "{{ reasoning_effort }}:{% for m in messages %}{{ m.content }}{% endfor %}"
    core = FakeCore(Tokenizer(backend, {}, template, [2]))
    server = Server(core)
    try:
        body = {"messages": ASK, "reasoning_effort": "low", "max_tokens": 1}
        assert request(server.port, "POST", "/v1/chat/completions", body)[0] == 200
        assert core.tokenizer.decode(core.submitted[-1].prompt_token_ids).startswith("low:")
        body["chat_template_kwargs"] = {"reasoning_effort": "high"}  # two answers: which?
        error = error_of(*request(server.port, "POST", "/v1/chat/completions", body)[::2], 400)
        assert error["param"] == "reasoning_effort"
    finally:
        server.stop()


# DeepSeek-V4's chat encoder (encoding/encoding_dsv4.py in its checkpoints, which ship no
# Jinja template) for one user turn: the generation prompt opens the thinking in thinking
# mode and closes it in chat mode (its ``thinking_mode``; here the kwarg ``thinking``).
V4_TEMPLATE = (
    "{% for m in messages %}{% if m.role == 'user' %}{{ '<｜User｜>' + m.content }}"
    "{% else %}{{ m.content }}{% endif %}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<｜Assistant｜>' + ('<think>' if thinking else '</think>') }}{% endif %}"
)


def test_deepseek_v4_thinking_split_as_its_encoder_prompts_it(tokenizer_dir: Path) -> None:
    from tokenizers import Tokenizer as HFTokenizer

    backend = HFTokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    core = FakeCore(Tokenizer(backend, {}, V4_TEMPLATE, [2]))
    server = Server(core, reasoning_parser="deepseek_v4")
    try:
        core.script = "The sky scatters blue light.</think>Blue."  # after the prompt's <think>
        body: dict[str, Any] = {"messages": ASK, "chat_template_kwargs": {"thinking": True}}
        answer = json.loads(request(server.port, "POST", "/v1/chat/completions", body)[2])
        message = answer["choices"][0]["message"]
        assert (message["reasoning"], message["content"]) == ("The sky scatters blue light.",
                                                              "Blue.")  # fmt: skip
        assert message["reasoning_content"] == message["reasoning"]
        core.script = "Blue."
        body["chat_template_kwargs"] = {"thinking": False}
        answer = json.loads(request(server.port, "POST", "/v1/chat/completions", body)[2])
        message = answer["choices"][0]["message"]
        assert (message["reasoning"], message["content"]) == (None, "Blue.")
        # Qwen3's switch would be ignored by this template: a 400 naming it and its own
        num_submitted = len(core.submitted)
        body["chat_template_kwargs"] = {"enable_thinking": False}
        error = error_of(*request(server.port, "POST", "/v1/chat/completions", body)[::2], 400)
        assert error["param"] == "chat_template_kwargs.enable_thinking"
        assert "reads: thinking" in error["message"]
        assert len(core.submitted) == num_submitted
    finally:
        server.stop()


def test_a_template_kwarg_nobody_reads_is_refused(port: int, core: FakeCore) -> None:
    body = {"messages": ASK, "chat_template_kwargs": {"enable_thinkng": False}}  # a typo
    error = error_of(*request(port, "POST", "/v1/chat/completions", body)[::2], 400)
    assert error["param"] == "chat_template_kwargs.enable_thinkng"
    assert error["code"] == "unsupported_parameter" and "enable_thinking" in error["message"]
    assert not core.submitted


@pytest.fixture
def port(served: tuple[FakeCore, int], core: FakeCore) -> int:
    return served[1]


def test_reasoning_sent_back_is_rendered_as_transformers_renders_it(
    client: Any, core: FakeCore, port: int, tokenizer_dir: Path
) -> None:
    transformers = pytest.importorskip("transformers")
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}  # fmt: skip
    turns = [*ASK, {"role": "assistant", "content": "", "tool_calls": [call]},
             {"role": "tool", "tool_call_id": "call_1", "content": "blue, 20 C"}]  # fmt: skip
    hf = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    for name in ("reasoning", "reasoning_content"):  # vLLM's name and DeepSeek's
        sent = [dict(m) for m in turns]
        sent[1][name] = "I should look it up."
        client.chat.completions.create(model="fake-model", messages=sent, tools=TOOLS)
        want = [dict(m) for m in turns]
        want[1]["reasoning_content"] = "I should look it up."
        text = hf.apply_chat_template(want, tools=TOOLS, tokenize=False,
                                      add_generation_prompt=True)  # fmt: skip
        assert "<think>\nI should look it up.\n</think>" in text
        ids = hf(text, add_special_tokens=False)["input_ids"]
        assert core.submitted[-1].prompt_token_ids == ids
    # on a message that is not the assistant's, or as two texts: a 400 naming it
    bad = [{**ASK[0], "reasoning": "x"}]
    error = error_of(*request(port, "POST", "/v1/chat/completions", {"messages": bad})[::2], 400)
    assert error["param"] == "messages[0].reasoning"
    both = [*ASK, {"role": "assistant", "content": "a", "reasoning": "x",
                   "reasoning_content": "y"}, ASK[0]]  # fmt: skip
    error = error_of(*request(port, "POST", "/v1/chat/completions", {"messages": both})[::2], 400)
    assert error["param"] == "messages[1].reasoning"


def test_reasoning_sent_to_a_template_that_drops_it_is_refused(model_dir: Path) -> None:
    core = FakeCore(Tokenizer.from_dir(model_dir))  # SmolLM2's template: no reasoning
    server = Server(core)
    try:
        turns = [*ASK, {"role": "assistant", "content": "Blue.", "reasoning_content": "hm"},
                 ASK[0]]  # fmt: skip
        status, _, data = request(server.port, "POST", "/v1/chat/completions", {"messages": turns})
        error = error_of(status, data, 400)
        assert error["param"] == "messages[1].reasoning_content"
        assert "would be dropped" in error["message"]
        # so is Qwen3's thinking switch, which this template never reads
        body = {"messages": ASK, "chat_template_kwargs": {"enable_thinking": False}}
        error = error_of(*request(server.port, "POST", "/v1/chat/completions", body)[::2], 400)
        assert error["param"] == "chat_template_kwargs.enable_thinking"
        assert "no variables of its own" in error["message"]
        # no reasoning parser there: answers carry no thinking and no reasoning usage
        status, _, data = request(server.port, "POST", "/v1/chat/completions",
                                  {"messages": ASK, "max_tokens": 2})  # fmt: skip
        answer = json.loads(data)
        assert answer["choices"][0]["message"]["reasoning"] is None
        assert "completion_tokens_details" not in answer["usage"]
    finally:
        server.stop()
