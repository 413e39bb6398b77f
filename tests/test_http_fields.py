"""Every field of the completions and chat requests is honoured (it reaches the engine's
SamplingParams, or the prompt) or refused with a 400 naming it; null means the default.
Against the fake core, through the openai SDK and raw HTTP."""

from __future__ import annotations

import json
from typing import Any

import pytest

from pdserve.common.engine.sampling_params import SamplingParams
from pdserve.common.model.checkpoint.tokenizer import Tokenizer
from tests import http_fakes
from tests.http_fakes import (
    CHAT,
    MODEL,
    FakeCore,
    error_of,
    request,
)

openai = pytest.importorskip("openai")

# The fixtures: one server over the fake core per module; `core` resets it per test.
server_core, core, port, client, tokenizer = (
    http_fakes.server_core,
    http_fakes.core,
    http_fakes.port,
    http_fakes.client,
    http_fakes.tokenizer,
)


# -- every field honoured or refused; null is the default -----------------------------------


def test_null_means_default(client: Any, core: FakeCore) -> None:
    client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
        temperature=None, top_p=None, n=None, stream=None, presence_penalty=None,
        frequency_penalty=None, seed=None, stop=None, logit_bias=None, logprobs=None,
        top_logprobs=None, tools=None, tool_choice=None, response_format=None,
        extra_body={"top_k": None, "min_p": None, "repetition_penalty": None,
                    "min_tokens": None, "ignore_eos": None, "echo": None},
    )  # fmt: skip
    assert core.submitted[-1].sampling == SamplingParams(max_tokens=2, temperature=1.0)


def test_sampling_fields_reach_the_engine(client: Any, core: FakeCore) -> None:
    client.completions.create(
        model=MODEL, prompt="hi", max_tokens=8, presence_penalty=0.5, frequency_penalty=-0.5,
        logit_bias={"17": -100, "3": 2.5},
        extra_body={"repetition_penalty": 1.3, "min_tokens": 4, "min_p": 0.1,
                    "include_stop_str_in_output": True},
    )  # fmt: skip
    sp = core.submitted[-1].sampling
    assert (sp.presence_penalty, sp.frequency_penalty, sp.repetition_penalty) == (0.5, -0.5, 1.3)
    assert (sp.min_tokens, sp.min_p, sp.include_stop_str_in_output) == (4, 0.1, True)
    assert sp.logit_bias == {17: -100.0, 3: 2.5}


@pytest.mark.parametrize(
    ("path", "extra", "param"),
    [
        ("/v1/completions", {"guided_json": "{no", "guided_regex": "a"}, "guided_json"),
        ("/v1/completions", {"guided_choice": []}, "guided_choice"),
        ("/v1/completions", {"guided_regex": "a+", "guided_choice": ["a"]}, "guided_choice"),
        ("/v1/completions", {"structured_outputs": {"json": {}, "regex": "a"}},
         "structured_outputs"),
        ("/v1/completions", {"guided_decoding_backend": "outlines"}, "guided_decoding_backend"),
        ("/v1/chat/completions", {"prompt_logprobs": 1}, "prompt_logprobs"),
        ("/v1/completions", {"suffix": "end"}, "suffix"),
        ("/v1/completions", {"use_beam_search": True}, "use_beam_search"),
        ("/v1/completions", {"skip_special_tokens": False}, "skip_special_tokens"),
        ("/v1/chat/completions", {"guided_json": {"type": "object"},
                                  "response_format": {"type": "json_object"}}, "guided_json"),
        ("/v1/chat/completions", {"functions": [{"name": "f"}]}, "functions"),
        ("/v1/chat/completions", {"function_call": "auto"}, "function_call"),
        ("/v1/chat/completions", {"tools": [{"type": "function"}]}, "tools[0]"),
        ("/v1/chat/completions", {"tool_choice": "required"}, "tool_choice"),
        ("/v1/chat/completions", {"tools": [{"type": "function", "function": {"name": "f"}}],
                                  "tool_choice": {"type": "function", "function": {"name": "g"}}},
         "tool_choice"),
        ("/v1/chat/completions", {"tools": [{"type": "function", "function": {"name": "f"}}],
                                  "tool_choice": "required",
                                  "response_format": {"type": "json_object"}}, "tool_choice"),
        ("/v1/chat/completions", {"chat_template": "{{ messages }}"}, "chat_template"),
        ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {
            "name": "x"}}}, "response_format"),
        ("/v1/chat/completions", {"response_format": {"type": "yaml"}}, "response_format"),
        ("/v1/chat/completions", {"continue_final_message": True, "add_generation_prompt": True},
         "continue_final_message"),
        ("/v1/chat/completions", {"messages": [
            {"role": "function", "name": "w", "content": "sunny"}]}, "messages[0]"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}, {
            "role": "assistant", "tool_calls": [{"id": "c", "function": 5}]}]}, "messages[1]"),
    ],
)  # fmt: skip
def test_unsupported_fields_are_refused_by_name(port: int, core: FakeCore, path: str,
                                                extra: dict[str, Any], param: str) -> None:  # fmt: skip
    body = {"prompt": "hi"} if path == "/v1/completions" else {"messages": CHAT}
    error = error_of(*request(port, "POST", path, {**body, **extra})[::2], 400)
    assert error["param"] == param and error["code"] == "unsupported_parameter"
    assert param.split("[")[0] in error["message"] and not core.submitted


def test_structured_output_reaches_the_engine(client: Any, core: FakeCore) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    for extra, kind, spec in [
        ({"response_format": {"type": "json_object"}}, "json_object", ""),
        ({"response_format": {"type": "json_schema",
                              "json_schema": {"name": "s", "schema": schema}}}, "json", schema),
        ({"extra_body": {"guided_json": json.dumps(schema)}}, "json", schema),
        ({"extra_body": {"guided_regex": "[0-9]+"}}, "regex", "[0-9]+"),
        ({"extra_body": {"guided_choice": ["yes", "no"]}}, "choice", ["yes", "no"]),
        ({"extra_body": {"structured_outputs": {"grammar": 'root ::= "x"'}}}, "grammar",
         'root ::= "x"'),
        ({"response_format": {"type": "text"}}, None, None),
    ]:  # fmt: skip
        client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=1, **extra)
        got = core.submitted[-1].sampling.structured
        if kind is None:
            assert got is None
            continue
        assert got.kind == kind
        assert (json.loads(got.spec) if kind in ("json", "choice") else got.spec) == spec
    with pytest.raises(openai.BadRequestError, match="'yaml' is not one of"):
        client.chat.completions.create(model=MODEL, messages=CHAT,
                                       response_format={"type": "yaml"})  # fmt: skip


def test_tool_choice_none_without_tools_is_accepted(client: Any, core: FakeCore) -> None:
    client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=1, tool_choice="none",
                                   parallel_tool_calls=False)  # fmt: skip
    assert len(core.submitted) == 1


def test_n_choices_with_seeds(client: Any, core: FakeCore, tokenizer: Tokenizer) -> None:
    prompt = "one two three"
    out = client.completions.create(model=MODEL, prompt=[prompt, "four"], n=3, max_tokens=2,
                                    seed=11, temperature=0.8)  # fmt: skip
    assert [c.index for c in out.choices] == list(range(6))
    # each prompt's first choice goes first (its KV then serves the others from the cache)
    assert [g.request_id.rsplit("-", 1)[1] for g in core.submitted[:2]] == ["0", "3"]
    by_index = sorted(core.submitted, key=lambda g: int(g.request_id.rsplit("-", 1)[1]))
    assert [g.sampling.seed for g in by_index] == [11, 12, 13, 11, 12, 13]
    assert [g.prompt_token_ids for g in by_index][:3] == [tokenizer.encode(prompt)] * 3
    # a prompt counts once however many choices it has, as OpenAI counts it
    assert out.usage.prompt_tokens == len(tokenizer.encode(prompt)) + len(tokenizer.encode("four"))
    assert out.usage.completion_tokens == 3 * 2 + 3 * 1
    chunks = list(client.chat.completions.create(model=MODEL, messages=CHAT, n=2, stream=True,
                                                 max_tokens=3, extra_body={"best_of": 2}))  # fmt: skip
    assert {c.choices[0].index for c in chunks if c.choices} == {0, 1}


def test_completion_echo(client: Any, core: FakeCore, tokenizer: Tokenizer) -> None:
    prompt = "Echo me"
    completion = tokenizer.decode(tokenizer.encode(prompt)[:2])
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, echo=True)
    assert out.choices[0].text == prompt + completion
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, echo=True,
                                            stream=True))  # fmt: skip
    assert "".join(c.choices[0].text for c in chunks if c.choices) == prompt + completion
    out = client.completions.create(model=MODEL, prompt=[5, 6, 7], max_tokens=1, echo=True)
    assert out.choices[0].text.startswith(tokenizer.decode([5, 6, 7]))


def test_completion_echo_with_logprobs(client: Any, core: FakeCore, tokenizer: Tokenizer,
                                       port: int) -> None:  # fmt: skip
    """lm-eval's loglikelihood request: the prompt's tokens first (the first without a
    logprob), then the generated one; streamed alike; vLLM's prompt_logprobs field."""
    ids = [[5, 6, 7], [8, 9]]
    out = client.completions.create(model=MODEL, prompt=ids, max_tokens=1, logprobs=1,
                                    echo=True, temperature=0, seed=1234)  # fmt: skip
    assert core.submitted[-1].sampling.prompt_logprobs == 1
    for choice in out.choices:
        prompt = ids[choice.index]
        lp = choice.logprobs
        text = [tokenizer.decode([t], skip_special_tokens=False) for t in prompt]
        assert lp.tokens == text + text[:1]  # the fake core answers the prompt's first token
        # the generated token: fake_logprobs at i=0 with seed 1234
        assert lp.token_logprobs == [None] + [-k / 10 for k in range(1, len(prompt))] + [-4.0]
        assert lp.top_logprobs[0] is None and len(lp.top_logprobs) == len(prompt) + 1
        assert all(lp.tokens[k] in lp.top_logprobs[k] for k in range(1, len(prompt) + 1))
        assert choice.text.startswith(tokenizer.decode(prompt))
    body = {"model": MODEL, "prompt": "Echo me", "max_tokens": 2, "logprobs": 2, "echo": True}
    whole = client.completions.create(**body).choices[0]
    chunks = [c.choices[0] for c in client.completions.create(**body, stream=True) if c.choices]
    assert "".join(c.text for c in chunks) == whole.text
    streamed = [v for c in chunks if c.logprobs for v in c.logprobs.token_logprobs]
    assert streamed == whole.logprobs.token_logprobs
    # max_tokens 0: the prompt scored, nothing generated (streamed alike)
    for stream in (False, True):
        body = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 0, "logprobs": 1, "echo": True}
        if stream:
            chunks = [c for c in client.completions.create(**body, stream=True,
                      stream_options={"include_usage": True})]  # fmt: skip
            usage = chunks[-1].usage
            choices = [c.choices[0] for c in chunks if c.choices]
            text = "".join(c.text for c in choices)
            lps = [v for c in choices if c.logprobs for v in c.logprobs.token_logprobs]
            reason = choices[-1].finish_reason
        else:
            out = client.completions.create(**body)
            usage, text, reason = out.usage, out.choices[0].text, out.choices[0].finish_reason
            lps = out.choices[0].logprobs.token_logprobs
        assert text == tokenizer.decode([5, 6, 7]) and lps == [None, -0.1, -0.2]
        assert (usage.prompt_tokens, usage.completion_tokens, reason) == (3, 0, "length")
    assert core.submitted[-1].sampling.max_tokens == 1
    error = error_of(*request(port, "POST", "/v1/completions",
                              {"prompt": "x", "max_tokens": 0})[::2], 400)  # fmt: skip
    assert error["param"] == "max_tokens"
    raw = client.completions.with_raw_response.create(
        model=MODEL, prompt=[5, 6, 7], max_tokens=1, extra_body={"prompt_logprobs": 1}
    ).http_response.json()["choices"][0]  # fmt: skip
    assert raw["logprobs"] is None
    assert raw["prompt_logprobs"][0] is None
    assert raw["prompt_logprobs"][1] == {
        "7": {
            "logprob": -1.1,
            "rank": 1,
            "decoded_token": tokenizer.decode([7], skip_special_tokens=False),
        },
        "6": {
            "logprob": -0.1,
            "rank": None,
            "decoded_token": tokenizer.decode([6], skip_special_tokens=False),
        },
    }


def test_chat_echo_and_continue_final_message(
    client: Any, core: FakeCore, tokenizer: Tokenizer
) -> None:
    messages = [{"role": "user", "content": "Name a color."},
                {"role": "assistant", "content": "The color is"}]  # fmt: skip
    out = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=1,
        extra_body={"echo": True, "continue_final_message": True,
                    "add_generation_prompt": False},
    )  # fmt: skip
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=False)
    cut = rendered[: rendered.rindex("The color is") + len("The color is")]
    ids = tokenizer.encode(cut, add_special_tokens=False)
    assert core.submitted[-1].prompt_token_ids == ids  # the turn is left open
    assert out.choices[0].message.content.startswith("The color is")
    client.chat.completions.create(model=MODEL, messages=messages[:1], max_tokens=1,
                                   extra_body={"add_generation_prompt": False})  # fmt: skip
    assert core.submitted[-1].prompt_token_ids == tokenizer.encode_chat(messages[:1], False)


def test_chat_template_kwargs(port: int, core: FakeCore, tokenizer: Tokenizer) -> None:
    body: dict[str, Any] = {"messages": CHAT, "max_tokens": 1}
    body["chat_template_kwargs"] = {"messages": []}
    error = error_of(*request(port, "POST", "/v1/chat/completions", body)[::2], 400)
    assert error["param"] == "chat_template_kwargs"
    body["chat_template_kwargs"] = {"bos_token": "<s>"}  # the template gets the model's own
    error = error_of(*request(port, "POST", "/v1/chat/completions", body)[::2], 400)
    assert error["param"] == "chat_template_kwargs.bos_token"
    # a kwarg the template never reads would be ignored: refused, naming it (vLLM drops it)
    assert "enable_thinking" not in tokenizer.template_variables  # SmolLM2's template
    body["chat_template_kwargs"] = {"enable_thinking": False}
    error = error_of(*request(port, "POST", "/v1/chat/completions", body)[::2], 400)
    assert (error["param"], error["code"]) == ("chat_template_kwargs.enable_thinking",
                                               "unsupported_parameter")  # fmt: skip
    assert error["type"] == "invalid_request_error"
    assert "does not read enable_thinking" in error["message"]
    assert not core.submitted


def test_template_kwargs_reach_the_template(tokenizer: Tokenizer) -> None:
    from tokenizers import Tokenizer as HFTokenizer

    backend = HFTokenizer.from_str(tokenizer._backend.to_str())
    template = "{{ greeting }}{% for m in messages %}{{ m.content }}{% endfor %}"
    custom = Tokenizer(backend, {}, template, [])
    assert custom.apply_chat_template(CHAT, template_kwargs={"greeting": "hey "}) == "hey x"
    assert custom.apply_chat_template(CHAT, template_kwargs={"messages": []}) == "x"
    assert custom.template_variables == {"greeting", "messages"}
    assert Tokenizer(backend, {}, None, []).template_variables == frozenset()
