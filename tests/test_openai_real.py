"""The OpenAI API's sampling fields against a real disaggregated deployment.

Each honoured field is checked where its effect is known exactly: repetition penalty and
min_tokens against Hugging Face transformers' own logits processors (greedy, fp32 CPU),
the first token (sampled by prefill) and the rest (decode) alike; the others against the
monolithic engine, or by what they must do to the text.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from pdserve.cli.deployment import Deployment
from pdserve.common.model.checkpoint.tokenizer import Tokenizer
from tests.e2e import deployment

pytestmark = pytest.mark.slow
openai = pytest.importorskip("openai")

NAME = "smol"
KEY = "test-key"
DAYS = "Monday, Tuesday,"


@pytest.fixture(scope="module")
def dep(tmp_path_factory: pytest.TempPathFactory, real_model_dir: Path) -> Iterator[Deployment]:
    with deployment(tmp_path_factory.mktemp("dep"), real_model_dir, engine={"max_model_len": 512},
                    served_model_name=[NAME, "alias"], api_key=KEY) as d:  # fmt: skip
        yield d


@pytest.fixture(scope="module")
def client(dep: Deployment) -> Any:
    return openai.OpenAI(base_url=f"{dep.url}/v1", api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def tok(real_model_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(real_model_dir)


@pytest.fixture(scope="module")
def hf_model(real_model_dir: Path) -> torch.nn.Module:
    transformers = pytest.importorskip("transformers")
    return transformers.AutoModelForCausalLM.from_pretrained(
        real_model_dir, dtype=torch.float32
    ).eval()


def hf_greedy(hf_model: torch.nn.Module, ids: list[int], num: int, **kwargs: Any) -> list[int]:
    with torch.no_grad():
        out = hf_model.generate(torch.tensor([ids]), max_new_tokens=num, do_sample=False,
                                pad_token_id=0, **kwargs)  # fmt: skip
    return out[0, len(ids) :].tolist()


def test_repetition_penalty_equals_transformers(client: Any, tok: Tokenizer,
                                                hf_model: torch.nn.Module) -> None:  # fmt: skip
    ids = tok.encode(DAYS)
    plain = client.completions.create(model=NAME, prompt=DAYS, max_tokens=24, temperature=0,
                                      extra_body={"ignore_eos": True})  # fmt: skip
    penalized = client.completions.create(
        model=NAME, prompt=DAYS, max_tokens=24, temperature=0,
        extra_body={"ignore_eos": True, "repetition_penalty": 2.0},
    )  # fmt: skip
    assert penalized.choices[0].text != plain.choices[0].text  # #18: it was ignored
    want = hf_greedy(hf_model, ids, 24, repetition_penalty=2.0, suppress_tokens=None)
    assert penalized.choices[0].text == tok.decode(want)


def test_min_tokens_equals_transformers(client: Any, tok: Tokenizer,
                                        hf_model: torch.nn.Module) -> None:  # fmt: skip
    messages = [{"role": "user", "content": "Reply with just the word OK."}]
    short = client.chat.completions.create(model=NAME, messages=messages, max_tokens=40,
                                           temperature=0)  # fmt: skip
    assert short.choices[0].finish_reason == "stop"  # EOS, before max_tokens
    at_least = short.usage.completion_tokens + 8
    longer = client.chat.completions.create(model=NAME, messages=messages, max_tokens=40,
                                            temperature=0, extra_body={"min_tokens": at_least})  # fmt: skip
    assert longer.usage.completion_tokens >= at_least
    want = hf_greedy(hf_model, tok.encode_chat(messages), 40, min_new_tokens=at_least)
    eos = set(tok.eos_token_ids)
    want_text = tok.decode([t for t in want if t not in eos])
    assert longer.choices[0].message.content == want_text


def test_logit_bias_acts_on_the_first_token_and_after(client: Any, tok: Tokenizer) -> None:
    forced = tok.encode(" banana", add_special_tokens=False)[0]
    out = client.completions.create(model=NAME, prompt="My favourite fruit is", max_tokens=4,
                                    temperature=0, logit_bias={str(forced): 100})  # fmt: skip
    # the first token is prefill's, the rest decode's: both honour it
    assert out.choices[0].text == tok.decode([forced] * 4)


def test_penalties_and_stop_string_kept(client: Any) -> None:
    base = {"model": NAME, "prompt": DAYS, "max_tokens": 24, "temperature": 0,
            "extra_body": {"ignore_eos": True}}  # fmt: skip
    plain = client.completions.create(**base).choices[0].text
    for field in ("frequency_penalty", "presence_penalty"):
        assert client.completions.create(**base, **{field: 2.0}).choices[0].text != plain
    stop = plain.split()[1]  # a word the answer reaches
    cut = client.completions.create(**{**base, "stop": [stop]}).choices[0].text
    kept = client.completions.create(
        **{**base, "stop": [stop], "extra_body": {"ignore_eos": True,
                                                   "include_stop_str_in_output": True}},
    ).choices[0].text  # fmt: skip
    assert kept == cut + stop and not cut.endswith(stop)


def test_n_with_a_seed_is_reproducible(client: Any) -> None:
    def ask() -> list[str]:
        out = client.completions.create(model=NAME, prompt="Once upon a time", n=3, seed=5,
                                        max_tokens=12, temperature=1.0)  # fmt: skip
        return [c.text for c in out.choices]

    first = ask()
    assert len(first) == 3 and len(set(first)) > 1 and ask() == first


def test_async_sdk_and_model_names(dep: Deployment) -> None:
    async def main() -> None:
        client = openai.AsyncOpenAI(base_url=f"{dep.url}/v1", api_key=KEY, max_retries=0)
        assert [m.id async for m in client.models.list()] == [NAME, "alias"]
        out = await client.chat.completions.create(
            model="alias", messages=[{"role": "user", "content": "Hi"}], max_tokens=3,
            temperature=None, top_p=None, presence_penalty=None,
        )  # fmt: skip
        assert out.model == "alias" and out.usage.completion_tokens >= 1
        with pytest.raises(openai.NotFoundError):
            await client.completions.create(model="gpt-4", prompt="x", max_tokens=1)
        bad = openai.AsyncOpenAI(base_url=f"{dep.url}/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            await bad.models.list()
        await client.close()
        await bad.close()

    asyncio.run(main())


def test_sdk_validates_as_http_does(dep: Deployment) -> None:
    from pdserve.services.router.client import Client, GenerationFailed

    with Client(dep.cfg.front_address, timeout=60) as sdk:
        with pytest.raises(GenerationFailed, match="max_model_len") as info:
            sdk.generate("hi", max_tokens=10**9)
        assert info.value.reason == "bad_request"
        with pytest.raises(GenerationFailed, match="outside the vocabulary"):
            sdk.generate("hi", logit_bias={10**7: 1.0})
        result = sdk.generate(DAYS, max_tokens=6, repetition_penalty=2.0, ignore_eos=True)
        assert len(result.token_ids) == 6


def hf_logprobs(hf_model: torch.nn.Module, prompt: list[int], output: list[int]) -> torch.Tensor:
    """[len(output), V]: transformers' log-softmax at each generated position (fp32 CPU)."""
    with torch.no_grad():
        logits = hf_model(torch.tensor([prompt + output])).logits[0].float()
    return torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1)


def test_logprobs_equal_transformers(client: Any, dep: Deployment, tok: Tokenizer,
                                     hf_model: torch.nn.Module) -> None:  # fmt: skip
    prompt = "The capital of France is"
    out = client.completions.create(model=NAME, prompt=prompt, max_tokens=8, temperature=0,
                                    logprobs=5, extra_body={"ignore_eos": True})  # fmt: skip
    lp = out.choices[0].logprobs
    from pdserve.services.router.client import Client

    with Client(dep.cfg.front_address, timeout=60) as sdk:  # the SDK: token ids and logprobs
        result = sdk.generate(prompt, max_tokens=8, logprobs=5, ignore_eos=True)
    output = result.token_ids
    assert [tok.decode([t], skip_special_tokens=False) for t in output] == lp.tokens
    want = hf_logprobs(hf_model, tok.encode(prompt), output)
    got = torch.tensor(lp.token_logprobs)
    # position 0 is prefill's first token, the rest decode's
    assert torch.allclose(got, want[torch.arange(8), torch.tensor(output)], atol=1e-4)
    for i, entry in enumerate(result.logprobs):
        top = want[i].topk(5)
        assert entry.top_ids == top.indices.tolist()
        assert torch.allclose(torch.tensor(entry.top_logprobs), top.values, atol=1e-4)
        assert entry.logprob == lp.token_logprobs[i]
    # chat, streamed and not: the same numbers, in OpenAI's chat shape
    messages = [{"role": "user", "content": "Name a fruit."}]
    chat = client.chat.completions.create(model=NAME, messages=messages, max_tokens=6,
                                          temperature=0, logprobs=True, top_logprobs=3)  # fmt: skip
    content = chat.choices[0].logprobs.content
    stream = client.chat.completions.create(model=NAME, messages=messages, max_tokens=6,
                                            temperature=0, logprobs=True, top_logprobs=3,
                                            stream=True)  # fmt: skip
    streamed = [c for ch in stream if ch.choices and ch.choices[0].logprobs
                for c in ch.choices[0].logprobs.content]  # fmt: skip
    assert [(c.token, c.logprob) for c in streamed] == [(c.token, c.logprob) for c in content]
    chat_ids = [tok.encode(c.token, add_special_tokens=False) for c in content]
    assert all(len(ids) >= 1 for ids in chat_ids)
    assert len(content) == chat.usage.completion_tokens
    assert all(len(c.top_logprobs) == 3 and c.top_logprobs[0].logprob >= c.logprob - 1e-6
               for c in content)  # greedy: the chosen token is the most likely  # fmt: skip


CITY_SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 24},
        "country": {"type": "string", "maxLength": 24},
        "is_capital": {"type": "boolean"},
    },
    "required": ["city", "country", "is_capital"],
    "additionalProperties": False,
}
CITIES = ["Paris", "Berlin", "Madrid", "Rome", "Lisbon", "Vienna", "Oslo", "Tokyo", "Lima",
          "Cairo", "Lyon", "Milan", "Porto", "Munich", "Osaka", "Quito", "Sydney", "Toronto",
          "Dublin", "Prague"]  # fmt: skip


def test_structured_output_validates(client: Any) -> None:
    pytest.importorskip("xgrammar")
    jsonschema = pytest.importorskip("jsonschema")
    prompts = [f"Describe the city of {c} as JSON with city, country and is_capital:\n"
               for c in CITIES]  # fmt: skip
    out = client.completions.create(
        model=NAME, prompt=prompts, max_tokens=60, temperature=0,
        extra_body={"response_format": {"type": "json_schema", "json_schema": {
            "name": "city", "schema": CITY_SCHEMA}}},
    )  # fmt: skip
    assert len(out.choices) == 20
    for choice in out.choices:
        assert choice.finish_reason == "stop", choice.text
        jsonschema.validate(json.loads(choice.text), CITY_SCHEMA)
    chat = client.chat.completions.create(
        model=NAME, messages=[{"role": "user", "content": "Is the sky blue?"}], max_tokens=5,
        temperature=1.0, seed=3, extra_body={"guided_choice": ["yes", "no"]},
    )  # fmt: skip
    assert chat.choices[0].message.content in ("yes", "no")
    obj = client.chat.completions.create(
        model=NAME, messages=[{"role": "user", "content": "Give me a JSON object."}],
        max_tokens=60, temperature=0, response_format={"type": "json_object"},
    )  # fmt: skip
    if obj.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(obj.choices[0].message.content), dict)
    else:  # the grammar holds at every token: what came out is a JSON object's prefix
        assert obj.choices[0].message.content.lstrip().startswith("{")


def test_colocated_gives_the_same_answers(
    tmp_path: Path, real_model_dir: Path, client: Any
) -> None:
    """Decode computing the prompt itself: the same penalties, logprobs and constraints."""
    body = {"model": NAME, "prompt": DAYS, "max_tokens": 10, "temperature": 0, "logprobs": 3,
            "extra_body": {"ignore_eos": True, "repetition_penalty": 1.5,
                           "logit_bias": {"11": 3.0}, "min_tokens": 5}}  # fmt: skip
    want = client.completions.create(**body).choices[0]
    with deployment(tmp_path, real_model_dir, engine={"max_model_len": 512}, colocated=True,
                    served_model_name=[NAME]) as colocated:  # fmt: skip
        local = openai.OpenAI(base_url=f"{colocated.url}/v1", api_key="x", max_retries=0)
        got = local.completions.create(**body).choices[0]
    assert got.text == want.text
    assert got.logprobs.tokens == want.logprobs.tokens
    assert torch.allclose(torch.tensor(got.logprobs.token_logprobs),
                          torch.tensor(want.logprobs.token_logprobs), atol=1e-4)  # fmt: skip
