"""Tool calling: the llama3_json and hermes parsers, the stream splitter, the chat
template seeing tools and tool messages as transformers shows them, and the HTTP API's
tool_calls (bodies and streams, through the openai SDK) against the fake core.

The real model forced to a call (tool_choice required / named, xgrammar) is in
tests/test_tool_calls_real.py.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from pdserve.common.model.checkpoint.tokenizer import Tokenizer
from pdserve.services.router import openai_schema as oa
from pdserve.services.router.chat_prompts import chat_prompt
from pdserve.services.router.tool_calls import (
    ToolStream,
    choice_of,
    constraint,
    detect_parser,
    functions_of,
    parse,
    parse_forced,
)
from tests.http_fakes import MODEL, FakeCore, Server, error_of, request

openai = pytest.importorskip("openai")

WEATHER = {"type": "object", "properties": {"city": {"type": "string"},
                                            "unit": {"enum": ["C", "F"]}},
           "required": ["city"]}  # fmt: skip
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather now",
                                      "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"type": "string"}}}}},
]  # fmt: skip
FUNCTIONS = functions_of(TOOLS)


# -- parsers --------------------------------------------------------------------------------


def test_hermes_parser() -> None:
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}'
            '\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n'
            "</tool_call>")  # fmt: skip
    content, calls = parse("hermes", text, FUNCTIONS)
    assert content == "Let me check."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris"}), ("get_time", {"zone": "CET"})]  # fmt: skip
    assert len({c.id for c in calls}) == 2 and all(c.type == "function" for c in calls)
    # cut short before the closing tag: still a call when its JSON is whole
    _, calls = parse("hermes", '<tool_call>{"name": "get_time", "arguments": {}}', FUNCTIONS)
    assert calls[0].function.name == "get_time" and calls[0].function.arguments == "{}"
    for text in ["No tools needed.", '<tool_call>{"name": "get_weather", "argu',
                 '<tool_call>{"name": "unknown", "arguments": {}}</tool_call>']:  # fmt: skip
        assert parse("hermes", text, FUNCTIONS) == (text, [])


def test_llama3_json_parser() -> None:
    one = '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "C"}}'
    for text in [one, "  " + one + "\n", "<|python_tag|>" + one]:
        content, calls = parse("llama3_json", text, FUNCTIONS)
        assert content is None and len(calls) == 1
        assert calls[0].function.name == "get_weather"
        assert json.loads(calls[0].function.arguments) == {"city": "Paris", "unit": "C"}
    _, calls = parse("llama3_json", one + '; {"name": "get_time", "parameters": {}}', FUNCTIONS)
    assert [c.function.name for c in calls] == ["get_weather", "get_time"]
    _, calls = parse("llama3_json", '{"name": "get_time", "arguments": {"zone": "UTC"}}',
                     FUNCTIONS)  # fmt: skip
    assert json.loads(calls[0].function.arguments) == {"zone": "UTC"}
    for text in ["The weather is fine.", '{"name": "get_weather", "parameters": {"ci',
                 '{"city": "Paris"}', '{"name": "nope", "parameters": {}}']:  # fmt: skip
        assert parse("llama3_json", text, FUNCTIONS) == (text, [])


def test_detect_parser_from_the_template() -> None:
    assert detect_parser(HERMES_TEMPLATE) == "hermes"
    assert detect_parser(LLAMA3_TEMPLATE) == "llama3_json"
    assert detect_parser(None) == "llama3_json"


def test_tool_choice_and_forced_grammars() -> None:
    assert choice_of(None, FUNCTIONS) == "auto" and choice_of(None, {}) == "none"
    assert choice_of({"type": "function", "function": {"name": "get_time"}},
                     FUNCTIONS) == "function:get_time"  # fmt: skip
    named = constraint("function:get_weather", FUNCTIONS, True)
    assert named is not None and json.loads(named.spec) == WEATHER
    required = constraint("required", FUNCTIONS, False)
    assert required is not None and required.kind == "json"
    schema = json.loads(required.spec)
    assert schema["type"] == "array" and schema["minItems"] == 1 and schema["maxItems"] == 1
    names = [alt["properties"]["name"]["const"] for alt in schema["items"]["anyOf"]]
    assert names == ["get_weather", "get_time"]
    assert "maxItems" not in json.loads(constraint("required", FUNCTIONS, True).spec)  # type: ignore[union-attr]
    assert constraint("auto", FUNCTIONS, True) is None
    calls = parse_forced("required", '[{"name": "get_time", "parameters": {"zone": "X"}}]',
                         FUNCTIONS)  # fmt: skip
    assert calls[0].function.name == "get_time"
    assert parse_forced("function:get_weather", '{"city": "Oslo"}', FUNCTIONS)[0].function == \
        calls[0].function.__class__(name="get_weather", arguments='{"city": "Oslo"}')  # fmt: skip
    assert parse_forced("required", '[{"name": "get_ti', FUNCTIONS) == []
    for bad in [[{"type": "function"}], [{"type": "code_interpreter"}], ["x"],
                [TOOLS[0], TOOLS[0]]]:  # fmt: skip
        with pytest.raises(ValueError, match=r"tools\["):
            functions_of(bad)


def test_tool_stream_sends_content_and_holds_calls() -> None:
    stream = ToolStream("hermes", forced=False)
    sent = [stream.feed(t) for t in ["Sure", ", one moment.", " <tool", '_call>{"name"', "}"]]
    assert "".join(sent) == "Sure, one moment. " and sent[2] == " "  # "<tool" held back
    assert stream.held() == '<tool_call>{"name"}'
    plain = ToolStream("hermes", forced=False)
    assert "".join(plain.feed(t) for t in ["a <b", "> c"]) == "a <b> c"
    llama = ToolStream("llama3_json", forced=False)
    assert [llama.feed(t) for t in ["  ", '{"na', 'me"']] == ["", "", ""]
    assert llama.held() == '  {"name"'
    text = ToolStream("llama3_json", forced=False)
    assert [text.feed(t) for t in ["  ", "Hi {", "x}"]] == ["", "  Hi {", "x}"]
    forced = ToolStream("llama3_json", forced=True)
    assert forced.feed("Anything") == "" and forced.held() == "Anything"


# -- chat templates with tools, against transformers ------------------------------------------

# Written for this test in the style of the two families (not their files): Llama 3's
# JSON calls with "parameters" and the "ipython" role for results; Qwen's / Hermes'
# <tools> list and <tool_call> blocks with "arguments", results in <tool_response>.
LLAMA3_TEMPLATE = """{{- bos_token }}
{%- if tools is not none %}<|start_header_id|>system<|end_header_id|>

Call a function by answering {"name": function name, "parameters": its arguments}.
{% for t in tools %}{{ t | tojson(indent=4) }}
{% endfor %}<|eot_id|>
{%- endif %}
{%- for m in messages %}
{%- if m.role == 'assistant' and m.tool_calls is defined %}<|start_header_id|>assistant<|end_header_id|>

{% for c in m.tool_calls %}{"name": "{{ c.function.name }}", "parameters": {{ c.function.arguments | tojson }}}{% endfor %}<|eom_id|>
{%- elif m.role == 'tool' %}<|start_header_id|>ipython<|end_header_id|>

{{ m.content }}<|eot_id|>
{%- else %}<|start_header_id|>{{ m.role }}<|end_header_id|>

{{ m.content }}<|eot_id|>
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>

{% endif %}"""

HERMES_TEMPLATE = """{%- if tools %}<|im_start|>system
You may call functions. Signatures:
<tools>
{%- for t in tools %}
{{ t | tojson }}
{%- endfor %}
</tools>
Answer <tool_call>{"name": ..., "arguments": ...}</tool_call> for each call.<|im_end|>
{% endif %}
{%- for m in messages %}
{%- if m.role == "assistant" and m.tool_calls %}<|im_start|>assistant
{% if m.content %}{{ m.content }}
{% endif %}
{%- for c in m.tool_calls %}<tool_call>
{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}
</tool_call>
{% endfor %}<|im_end|>
{% elif m.role == "tool" %}<|im_start|>user
<tool_response>
{{ m.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

HISTORY = [
    {"role": "user", "content": "Weather in Paris & time in Tokyo?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "C"}'}},
        {"id": "call_2", "type": "function",
         "function": {"name": "get_time", "arguments": '{"zone": "Asia/Tokyo"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "18 C, <sunny>"},
    {"role": "tool", "tool_call_id": "call_2", "content": "21:04"},
]  # fmt: skip


class _Core:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer


@pytest.mark.parametrize("template", [LLAMA3_TEMPLATE, HERMES_TEMPLATE], ids=["llama3", "hermes"])
def test_tools_and_tool_messages_render_as_transformers(model_dir: Any, hf_tokenizer: Any,
                                                        template: str) -> None:  # fmt: skip
    base = Tokenizer.from_dir(model_dir)
    tok = Tokenizer(base._backend, base.special_tokens, template, base.eos_token_ids)
    req = oa.decode_request(json.dumps({"messages": HISTORY, "tools": TOOLS}).encode(),
                            oa.ChatCompletionRequest)  # fmt: skip
    assert req.unsupported() is None
    ours = chat_prompt(_Core(tok), req)  # type: ignore[arg-type]
    # transformers' convention: a call's arguments are a mapping
    hf_history = json.loads(json.dumps(HISTORY))
    for call in hf_history[1]["tool_calls"]:
        call["function"]["arguments"] = json.loads(call["function"]["arguments"])
    text = hf_tokenizer.apply_chat_template(hf_history, tools=TOOLS, chat_template=template,
                                            tokenize=False, add_generation_prompt=True)  # fmt: skip
    assert "Asia/Tokyo" in text and "18 C, <sunny>" in text and "get_time" in text
    assert tok.decode(ours, skip_special_tokens=False) == text
    assert ours == hf_tokenizer.encode(text, add_special_tokens=False)


# -- the HTTP API --------------------------------------------------------------------------------


@pytest.fixture(scope="module", params=["llama3_json", "hermes"])
def served(request: pytest.FixtureRequest, model_dir: Any) -> Iterator[tuple[str, FakeCore, int]]:
    core = FakeCore(Tokenizer.from_dir(model_dir))
    server = Server(core, tool_call_parser=request.param)
    yield request.param, core, server.port
    server.stop()


def call_text(parser: str, name: str, args: dict[str, Any]) -> str:
    if parser == "hermes":
        return f"<tool_call>\n{json.dumps({'name': name, 'arguments': args})}\n</tool_call>"
    return json.dumps({"name": name, "parameters": args})


ASK = [{"role": "user", "content": "Weather in Paris?"}]


def test_auto_tool_calls_in_bodies_and_streams(served: tuple[str, FakeCore, int]) -> None:
    parser, core, port = served
    core.reset()
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
    core.script = call_text(parser, "get_weather", {"city": "Paris"})
    out = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=64)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    assert core.submitted[-1].sampling.structured is None  # auto: free text, parsed
    # streamed: the call's id, type and name, then its arguments, then finish_reason
    chunks = list(client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS,
                                                 max_tokens=64, stream=True))  # fmt: skip
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    calls = [d.tool_calls[0] for d in deltas if d.tool_calls]
    assert [(c.index, c.id is not None, c.function.name) for c in calls] == [
        (0, True, "get_weather"), (0, False, None)]  # fmt: skip
    assert json.loads(calls[0].function.arguments + calls[1].function.arguments) == {
        "city": "Paris"}  # fmt: skip
    assert not "".join(d.content or "" for d in deltas)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    # plain text is content, streamed as it comes; tool_choice none does not parse
    core.script = "It is sunny in Paris."
    out = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=64)
    assert out.choices[0].message.content == core.script and not out.choices[0].message.tool_calls
    chunks = list(client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS,
                                                 max_tokens=64, stream=True))  # fmt: skip
    texts = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert "".join(texts) == core.script and len(texts) > 1
    core.script = call_text(parser, "get_weather", {"city": "Paris"})
    out = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=64,
                                         tool_choice="none")  # fmt: skip
    assert out.choices[0].message.content == core.script
    assert out.choices[0].finish_reason == "length" or out.choices[0].finish_reason == "stop"


def test_forced_tool_choice_constrains_and_parses(served: tuple[str, FakeCore, int]) -> None:
    _, core, port = served
    core.reset()
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
    core.script = '{"city": "Oslo"}'
    named = {"type": "function", "function": {"name": "get_weather"}}
    for stream in (False, True):
        if stream:
            chunks = list(client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS,
                                                         tool_choice=named, stream=True))  # fmt: skip
            calls = [c.choices[0].delta.tool_calls[0] for c in chunks
                     if c.choices and c.choices[0].delta.tool_calls]  # fmt: skip
            name, args = (
                calls[0].function.name,
                calls[0].function.arguments + calls[1].function.arguments,
            )
        else:
            out = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS,
                                                 tool_choice=named)  # fmt: skip
            call = out.choices[0].message.tool_calls[0]
            name, args = call.function.name, call.function.arguments
        assert (name, json.loads(args)) == ("get_weather", {"city": "Oslo"})
        structured = core.submitted[-1].sampling.structured
        assert structured.kind == "json" and json.loads(structured.spec) == WEATHER
    core.script = '[{"name": "get_time", "parameters": {"zone": "UTC"}}]'
    out = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS,
                                         tool_choice="required", parallel_tool_calls=False)  # fmt: skip
    assert out.choices[0].message.tool_calls[0].function.name == "get_time"
    assert json.loads(core.submitted[-1].sampling.structured.spec)["maxItems"] == 1


def test_tool_history_reaches_the_prompt(served: tuple[str, FakeCore, int]) -> None:
    _, core, port = served
    core.reset()
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
    client.chat.completions.create(model=MODEL, messages=HISTORY, tools=TOOLS, max_tokens=1)
    prompt = core.tokenizer.decode(core.submitted[-1].prompt_token_ids)
    # the embedded model's template shows contents only; the results must be among them
    assert "18 C, <sunny>" in prompt and "21:04" in prompt


def test_tokenize_renders_tools_as_chat_completions_do(model_dir: Any) -> None:
    """/tokenize with tools counts what a chat completion with those tools is given (the
    template shows them); before, tools were dropped and the count was short."""
    base = Tokenizer.from_dir(model_dir)
    core = FakeCore(Tokenizer(base._backend, base.special_tokens, HERMES_TEMPLATE,
                              base.eos_token_ids))  # fmt: skip
    server = Server(core)
    try:
        port = server.port
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
        client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=1)
        seen = core.submitted[-1].prompt_token_ids
        body = {"messages": ASK, "tools": TOOLS, "return_token_strs": True}
        status, _, data = request(port, "POST", "/tokenize", body)
        out = json.loads(data)
        assert status == 200 and out["tokens"] == seen and out["count"] == len(seen)
        assert "get_weather" in "".join(out["token_strs"])
        plain = json.loads(request(port, "POST", "/tokenize", {"messages": ASK})[2])
        assert plain["count"] < out["count"]
        bad = {"messages": ASK, "tools": [{"type": "function", "function": {}}]}
        assert error_of(*request(port, "POST", "/tokenize", bad)[::2], 400)["param"] == "tools[0]"
        with_prompt = {"prompt": "hi", "tools": TOOLS}
        assert error_of(*request(port, "POST", "/tokenize", with_prompt)[::2], 400)["param"] == (
            "tools"
        )
    finally:
        server.stop()
