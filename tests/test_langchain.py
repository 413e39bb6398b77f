"""LangChain's ChatOpenAI against a real disaggregated deployment, as a LangChain user
points it at pdserve: invoke, stream, logprobs (equal to transformers' log-softmax, fp32
CPU), and bind_tools giving a parsed tool call (forced with a named tool_choice, so the
135M embedded model answers one; xgrammar holds the output to it).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import pytest
import torch

from pdserve.cli.deployment import Deployment
from pdserve.common.model.checkpoint.tokenizer import Tokenizer
from tests.e2e import deployment
from tests.test_openai_real import hf_logprobs

pytestmark = pytest.mark.slow
langchain_openai = pytest.importorskip(
    "langchain_openai", reason="langchain-openai is not installed (pip install -e '.[test]')"
)
pytest.importorskip("xgrammar", reason="xgrammar is not installed (forced tool calls need it)")

NAME = "smol"
POEM = "Write a short poem about the sea."


@pytest.fixture(scope="module")
def dep(tmp_path_factory: pytest.TempPathFactory, real_model_dir: Path) -> Iterator[Deployment]:
    with deployment(tmp_path_factory.mktemp("dep"), real_model_dir, engine={"max_model_len": 1024},
                    served_model_name=[NAME]) as d:  # fmt: skip
        yield d


@pytest.fixture(scope="module")
def tok(real_model_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(real_model_dir)


def chat_model(dep: Deployment, **kwargs: Any) -> Any:
    return langchain_openai.ChatOpenAI(base_url=f"{dep.url}/v1", api_key="unused", model=NAME,
                                       temperature=0, max_retries=0, timeout=120,
                                       **kwargs)  # fmt: skip


def test_invoke_and_stream(dep: Deployment, tok: Tokenizer) -> None:
    llm = chat_model(dep, max_tokens=12, stream_usage=True)
    message = llm.invoke(POEM)
    assert isinstance(message.content, str) and message.content.strip()
    assert message.response_metadata["model_name"] == NAME
    assert message.response_metadata["finish_reason"] in ("length", "stop")
    usage = message.usage_metadata
    # what the template renders, counted by the model's tokenizer
    assert usage["input_tokens"] == len(tok.encode_chat([{"role": "user", "content": POEM}]))
    assert 1 <= usage["output_tokens"] <= 12
    chunks = list(llm.stream(POEM))
    assert len([c for c in chunks if c.content]) > 1  # streamed, not one body
    whole = chunks[0]
    for chunk in chunks[1:]:
        whole = whole + chunk
    assert whole.content == message.content  # greedy: the same text
    assert whole.usage_metadata["input_tokens"] == usage["input_tokens"]
    assert whole.usage_metadata["output_tokens"] == usage["output_tokens"]


def test_logprobs_equal_transformers(dep: Deployment, tok: Tokenizer, real_model_dir: Path) -> None:
    transformers = pytest.importorskip("transformers")
    llm = chat_model(dep, max_tokens=8, logprobs=True, top_logprobs=3,
                     extra_body={"ignore_eos": True})  # fmt: skip
    message = llm.invoke(POEM)
    content = message.response_metadata["logprobs"]["content"]
    assert "".join(c["token"] for c in content) == message.content
    prompt = tok.encode_chat([{"role": "user", "content": POEM}])
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(
        real_model_dir, dtype=torch.float32
    )
    with torch.no_grad():
        output = hf_model.eval().generate(torch.tensor([prompt]), max_new_tokens=8,
                                          do_sample=False, pad_token_id=0)[0, len(prompt) :]  # fmt: skip
    output_ids = output.tolist()
    assert [c["token"] for c in content] == [tok.decode([t], skip_special_tokens=False)
                                             for t in output_ids]  # fmt: skip
    want = hf_logprobs(hf_model, prompt, output_ids)  # [8, V]
    got = torch.tensor([c["logprob"] for c in content])
    assert torch.allclose(got, want[torch.arange(8), output], atol=1e-4)
    for i, entry in enumerate(content):
        top = want[i].topk(3)
        assert [t["token"] for t in entry["top_logprobs"]] == [
            tok.decode([t], skip_special_tokens=False) for t in top.indices.tolist()
        ]
        got_top = torch.tensor([t["logprob"] for t in entry["top_logprobs"]])
        assert torch.allclose(got_top, top.values, atol=1e-4)
    # streamed: the same tokens and numbers, chunk by chunk
    streamed = [c for chunk in llm.stream(POEM)
                for c in (chunk.response_metadata.get("logprobs") or {}).get("content") or []]  # fmt: skip
    assert [(c["token"], c["logprob"]) for c in streamed] == [
        (c["token"], c["logprob"]) for c in content
    ]


def get_weather(city: str, unit: Literal["C", "F"] = "C") -> str:
    """The weather now in a city.

    Args:
        city: the city's name
        unit: degrees Celsius (C) or Fahrenheit (F)
    """
    return f"18 {unit} in {city}"


def get_time(zone: str) -> str:
    """The time now in a time zone.

    Args:
        zone: an IANA time zone name
    """
    return "12:00"


ASK = "What is the weather in Paris, in Celsius?"


@pytest.mark.parametrize("stream", [False, True], ids=["invoke", "stream"])
def test_bind_tools_gives_a_parsed_tool_call(dep: Deployment, stream: bool) -> None:
    llm = chat_model(dep, max_tokens=120)
    named = llm.bind_tools([get_weather, get_time], tool_choice="get_weather")
    if stream:
        chunks = list(named.stream(ASK))
        message = chunks[0]
        for chunk in chunks[1:]:
            message = message + chunk
    else:
        message = named.invoke(ASK)
    assert message.response_metadata["finish_reason"] == "tool_calls"
    assert not message.invalid_tool_calls
    [call] = message.tool_calls
    assert call["name"] == "get_weather" and call["id"]
    assert isinstance(call["args"].get("city"), str) and call["args"]["city"]
    assert set(call["args"]) <= {"city", "unit"}
    # "any" is LangChain's spelling of tool_choice required
    anyone = llm.bind_tools([get_weather, get_time], tool_choice="any", parallel_tool_calls=False)
    message = anyone.invoke(ASK)
    [call] = message.tool_calls
    assert call["name"] in ("get_weather", "get_time") and isinstance(call["args"], dict)
