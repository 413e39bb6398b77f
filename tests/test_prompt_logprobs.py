"""Prompt logprobs (completions echo + logprobs, vLLM's prompt_logprobs) against Hugging
Face transformers' log-softmax (fp32, CPU): the engine with chunked prefill, PCP ranks
against one rank, and real deployments (disaggregated, colocated, PCP 2) through the
openai SDK, in the request shape lm-eval's local-completions model sends.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from pdserve.cli.deployment import Deployment
from pdserve.common.engine.config import EngineConfig
from pdserve.common.engine.llm_engine import LLMEngine
from pdserve.common.engine.sampling import SamplingParams
from pdserve.common.engine.step_plan import ScheduledSeq, StepPlan
from pdserve.common.model.checkpoint.tokenizer import Tokenizer
from tests.e2e import deployment

pytestmark = pytest.mark.slow
ATOL = 1e-4
TOP = 3
TEXTS = ["Question: What is the capital of France?\nAnswer: Paris",
         "The quick brown fox jumps over the lazy dog. " * 6]  # fmt: skip


@pytest.fixture(scope="module")
def hf_model(model_dir: Path) -> torch.nn.Module:
    transformers = pytest.importorskip("transformers")
    return transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def tok(model_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(model_dir)


def hf_prompt_logprobs(hf_model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    """[len(ids) - 1, V]: row i is the log-softmax predicting ids[i + 1]."""
    with torch.no_grad():
        logits = hf_model(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits[:-1], dim=-1)


def check(entries: list[Any], ids: list[int], want: torch.Tensor, top: int) -> None:
    """``entries``: TokenLogprobs of prompt tokens 1.. (the engine's / the SDK's)."""
    assert [e.token_id for e in entries] == ids[1:]
    got = torch.tensor([e.logprob for e in entries])
    assert torch.allclose(got, want[torch.arange(len(ids) - 1), torch.tensor(ids[1:])], atol=ATOL)
    for i, e in enumerate(entries):
        best = want[i].topk(top)
        assert torch.allclose(torch.tensor(e.top_logprobs), best.values, atol=ATOL)
        # ids may swap only where the values tie within the tolerance
        for j, (a, b) in enumerate(zip(e.top_ids, best.indices.tolist(), strict=True)):
            assert a == b or abs(want[i, a] - best.values[j]) < ATOL


def test_engine_prompt_logprobs_over_chunks_equal_transformers(
    model_dir: Path, tok: Tokenizer, hf_model: torch.nn.Module
) -> None:
    # 24-token steps: the long prompt is prefilled in several chunks; the prefix cache holds
    # the first prompt's blocks, which a scored request must compute anyway
    engine = LLMEngine(EngineConfig(model=str(model_dir), block_size=16,
                                    max_num_batched_tokens=24, kv_cache_memory_gb=0.1))  # fmt: skip
    prompts = [tok.encode(t) for t in TEXTS]
    engine.generate([prompts[0]], SamplingParams(max_tokens=2))  # cache its blocks
    for ids in prompts:
        engine.add_request(f"r{len(ids)}", ids, SamplingParams(max_tokens=2, prompt_logprobs=TOP))
    firsts = {}
    while engine.has_unfinished:
        for out in engine.step():
            if out.prompt_logprobs is not None:
                firsts[out.request_id] = out.prompt_logprobs
    for ids in prompts:
        check(firsts[f"r{len(ids)}"], ids, hf_prompt_logprobs(hf_model, ids), TOP)


@pytest.mark.parametrize("num_ranks", [2])
def test_pcp_ranks_score_their_positions_as_one_rank(model_dir: Path, num_ranks: int) -> None:
    from pdserve.common.engine.model_runner import ModelRunner
    from pdserve.common.model.checkpoint.config import ModelConfig
    from pdserve.services.ranks.group import RankGroup

    cfg = EngineConfig(model=str(model_dir), num_kv_blocks=12)
    ref = ModelRunner.from_config(ModelConfig.from_dir(model_dir), model_dir, cfg)
    group = RankGroup.prefill(cfg, num_ranks, "prefill-test", 1)
    try:
        ids = torch.randint(0, 49152, (150,), generator=torch.Generator().manual_seed(1)).tolist()
        steps = [  # two chunks; the second chunk's last position is the prompt's: unscored
            StepPlan(
                [
                    ScheduledSeq(
                        "p",
                        ids[:100],
                        0,
                        [2, 3, 4, 5],
                        False,
                        score_next_ids=ids[1:101],
                        score_top=2,
                    )
                ]
            ),  # fmt: skip
            StepPlan(
                [
                    ScheduledSeq(
                        "p",
                        ids[100:],
                        100,
                        [2, 3, 4, 5],
                        True,
                        score_next_ids=ids[101:],
                        score_top=2,
                    )
                ]
            ),  # fmt: skip
        ]
        for plan in steps:
            torch.testing.assert_close(group.execute(plan), ref.execute(plan), rtol=0, atol=1e-4)
            want = dict(ref.last_prompt_logprobs["p"])
            got = dict(group.last_prompt_logprobs["p"])
            assert sorted(got) == sorted(want)
            for pos, lp in want.items():
                assert got[pos].token_id == lp.token_id
                assert abs(got[pos].logprob - lp.logprob) < ATOL
        assert sorted(group.last_prompt_logprobs["p"])[-1][0] == 148  # predicts ids[149]
    finally:
        group.close()


# -- through the HTTP API ---------------------------------------------------------------

openai = pytest.importorskip("openai")


@pytest.fixture(scope="module")
def dep(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> Iterator[Deployment]:
    # small steps: the prompts are prefilled in chunks
    with deployment(tmp_path_factory.mktemp("dep"), model_dir,
                    engine={"max_model_len": 512, "max_num_batched_tokens": 32}) as d:  # fmt: skip
        yield d


def lm_eval_request(client: Any, prompts: list[list[int]]) -> Any:
    """What lm-eval's local-completions model sends for loglikelihood requests."""
    return client.completions.create(model=client.model_name, prompt=prompts, temperature=0,
                                     max_tokens=1, logprobs=1, seed=1234, echo=True)  # fmt: skip


def check_echo(choice: Any, ids: list[int], want: torch.Tensor, tok: Tokenizer) -> None:
    lp = choice.logprobs
    n = len(ids)
    assert lp.tokens[:n] == [tok.decode([t], skip_special_tokens=False) for t in ids]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    got = torch.tensor(lp.token_logprobs[1:n])
    assert torch.allclose(got, want[torch.arange(n - 1), torch.tensor(ids[1:])], atol=ATOL)
    for i in range(1, n):  # the prompt token's own entry, and the most likely one
        top = lp.top_logprobs[i]
        assert lp.tokens[i] in top
        assert max(top.values()) == pytest.approx(want[i - 1].max().item(), abs=ATOL)
    assert len(lp.tokens) == n + 1  # then the generated token's
    # lm-eval: sum(token_logprobs[ctxlen:-1]) and is_greedy from top_logprobs
    assert lp.text_offset[:2] == [0, len(lp.tokens[0])]


def answers_match_transformers(url: str, tok: Tokenizer, hf_model: torch.nn.Module) -> None:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
    client.model_name = client.models.list().data[0].id
    prompts = [tok.encode(t) for t in TEXTS]
    out = lm_eval_request(client, prompts)
    wants = [hf_prompt_logprobs(hf_model, ids) for ids in prompts]
    for choice in out.choices:
        check_echo(choice, prompts[choice.index], wants[choice.index], tok)
    # a text prompt echoes its text; streamed, the prompt's logprobs come first, the same
    text = TEXTS[0]
    body = {"model": client.model_name, "prompt": text, "max_tokens": 2, "temperature": 0,
            "logprobs": 2, "echo": True}  # fmt: skip
    whole = client.completions.create(**body).choices[0]
    assert whole.text.startswith(text)
    chunks = list(client.completions.create(**body, stream=True))
    streamed = [c.choices[0] for c in chunks if c.choices and c.choices[0].logprobs]
    assert streamed[0].text == text
    assert streamed[0].logprobs.token_logprobs[0] is None
    assert [v for s in streamed for v in s.logprobs.token_logprobs] == whole.logprobs.token_logprobs
    # max_tokens 0 (vLLM's scoring request): the prompt's entries alone
    zero = client.completions.create(model=client.model_name, prompt=[prompts[0]], max_tokens=0,
                                     echo=True, logprobs=1, temperature=0)  # fmt: skip
    assert zero.usage.completion_tokens == 0
    scored = zero.choices[0].logprobs.token_logprobs
    assert scored[0] is None and len(scored) == len(prompts[0])
    assert scored[1:] == pytest.approx(out.choices[0].logprobs.token_logprobs[1:-1], abs=ATOL)
    # vLLM's prompt_logprobs field, without echo
    ids = prompts[0]
    raw = client.completions.with_raw_response.create(
        model=client.model_name, prompt=ids, max_tokens=1, temperature=0,
        extra_body={"prompt_logprobs": 2},
    ).http_response.json()["choices"][0]  # fmt: skip
    field = raw["prompt_logprobs"]
    assert field[0] is None and len(field) == len(ids)
    for i, entry in enumerate(field[1:]):
        assert entry[str(ids[i + 1])]["logprob"] == pytest.approx(
            wants[0][i, ids[i + 1]].item(), abs=ATOL
        )
        ranked = sorted((e["rank"], e["logprob"]) for e in entry.values() if e["rank"])
        assert [r for r, _ in ranked] == [1, 2]
    assert raw["logprobs"] is None and not raw["text"].startswith(TEXTS[0])


def test_echo_logprobs_equal_transformers(dep: Deployment, tok: Tokenizer,
                                          hf_model: torch.nn.Module) -> None:  # fmt: skip
    answers_match_transformers(dep.url, tok, hf_model)
    from pdserve.services.router.client import Client

    ids = tok.encode(TEXTS[1])
    with Client(dep.cfg.front_address, timeout=120) as sdk:  # the SDK: TokenLogprobs
        result = sdk.generate(prompt_token_ids=ids, max_tokens=1, prompt_logprobs=TOP)
    assert result.prompt_logprobs is not None
    check(result.prompt_logprobs, ids, hf_prompt_logprobs(hf_model, ids), TOP)


def test_echo_logprobs_colocated_and_pcp(tmp_path: Path, model_dir: Path, tok: Tokenizer,
                                         hf_model: torch.nn.Module) -> None:  # fmt: skip
    engine = {"max_model_len": 512, "max_num_batched_tokens": 32}
    with deployment(tmp_path / "colocated", model_dir, engine=engine, colocated=True) as d:
        answers_match_transformers(d.url, tok, hf_model)
    with deployment(tmp_path / "pcp", model_dir, engine=engine, pcp=2) as d:
        answers_match_transformers(d.url, tok, hf_model)


def test_chat_refuses_prompt_logprobs(dep: Deployment) -> None:
    client = openai.OpenAI(base_url=f"{dep.url}/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.BadRequestError, match="prompt_logprobs"):
        client.chat.completions.create(model=client.models.list().data[0].id, max_tokens=1,
                                       messages=[{"role": "user", "content": "hi"}],
                                       extra_body={"prompt_logprobs": 1})  # fmt: skip


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_engine_prompt_logprobs_on_cuda_equal_transformers(
    model_dir: Path, tok: Tokenizer, hf_model: torch.nn.Module
) -> None:
    """fp32 on the GPU, CUDA graphs on (a scored step must leave the graphs alone), chunked
    prefill: the same numbers as transformers on CPU."""
    engine = LLMEngine(EngineConfig(model=str(model_dir), device="cuda", dtype="float32",
                                    max_num_batched_tokens=24))  # fmt: skip
    ids = tok.encode(TEXTS[1])
    engine.add_request("r", ids, SamplingParams(max_tokens=4, prompt_logprobs=TOP))
    got = None
    while engine.has_unfinished:
        for out in engine.step():
            got = out.prompt_logprobs if out.prompt_logprobs is not None else got
    assert got is not None
    check(got, ids, hf_prompt_logprobs(hf_model, ids), TOP)
