"""The reasoning split on token ids (services/router/reasoning.py), without sockets: every
way a stream can cut an output into chunks, the engine's text lagging its tokens, where a
choice starts, the grammar's gate, and the parser chosen from a chat template."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest

from pdserve.common.engine.sampling_params import StructuredOutput
from pdserve.common.errors import PdserveError
from pdserve.common.model.checkpoint.tokenizer import Tokenizer
from pdserve.services.router.reasoning import (
    THINKS_UNPROMPTED,
    ReasoningParser,
    Start,
    ThinkingSplit,
    detect,
    parser_of,
    template_reads,
    template_reads_key,
)
from tests.reasoning_model import QWEN3_TEMPLATE, thinking_tokenizer

START, END = 1, 2
TEXT = {START: "<think>", END: "</think>", 3: "\n", 4: "Hmm", 5: ",", 6: " sky", 7: "Blue", 8: "!"}
QWEN3 = ReasoningParser(name="qwen3", start_id=START, end_id=END, thinks_unprompted=False)
R1 = ReasoningParser(name="deepseek_r1", start_id=START, end_id=END, thinks_unprompted=True)
OUTPUT = [START, 3, 4, 5, 6, 3, END, 3, 3, 7, 8]  # <think>\nHmm, sky\n</think>\n\nBlue!


def decode(ids: Sequence[int]) -> str:
    return "".join(TEXT[t] for t in ids)


def decode_skipping(ids: Sequence[int]) -> str:
    """A tokenizer whose markers are special tokens, which the engine's text skips."""
    return "".join(TEXT[t] for t in ids if t not in (START, END))


def run(chunks: list[list[int]], start: Start = "maybe", parser: ReasoningParser = QWEN3,
        dec: Callable[[Sequence[int]], str] = decode, lag: int = 0) -> tuple[str, str]:  # fmt: skip
    """Feed ``chunks`` as the engine sends them; ``lag``: its text comes this many chunks
    after its tokens (held back: a partial character, a possible stop string)."""
    split = ThinkingSplit(parser, start, dec)
    seen: list[int] = []
    texts = []
    for chunk in chunks:
        seen += chunk
        texts.append(dec(seen))
    deltas = [b[len(a) :] for a, b in zip(["", *texts], texts, strict=False)]
    deltas = [""] * lag + deltas  # text late; the rest comes with the last chunk
    deltas = deltas[: len(chunks) - 1] + ["".join(deltas[len(chunks) - 1 :])]
    thought, answer = zip(*(split.feed(c, t) for c, t in zip(chunks, deltas, strict=True)),
                          strict=True)  # fmt: skip
    return "".join(thought), "".join(answer)


def cuts(ids: list[int], num: int) -> list[list[list[int]]]:
    """Every way of cutting ``ids`` into ``num`` + 1 non-empty chunks."""
    out = []
    for points in itertools.combinations(range(1, len(ids)), num):
        bounds = [0, *points, len(ids)]
        out.append([ids[a:b] for a, b in itertools.pairwise(bounds)])
    return out


def test_every_cut_of_the_stream_gives_the_whole_answer() -> None:
    want = ("\nHmm, sky\n", "\n\nBlue!")
    assert run([OUTPUT]) == want
    for num in (1, 2, 3):
        for chunks in cuts(OUTPUT, num):
            assert run(chunks) == want, chunks
            assert run(chunks, lag=1) == want, chunks  # the text a chunk late
    # one token a chunk, text two chunks late, markers special (not in the text)
    assert run([[t] for t in OUTPUT], lag=2) == want
    assert run([[t] for t in OUTPUT], dec=decode_skipping) == want


def test_where_a_choice_starts() -> None:
    assert run([[4, 5, END, 7]], start="thinking") == ("Hmm,", "Blue")  # R1's prompt opened it
    assert run([[START, 4, END, 7]], start="thinking") == ("Hmm", "Blue")
    assert run([[7, 8]], start="maybe") == ("", "Blue!")  # Qwen3 that does not think
    assert run([[7, 8]], start="answer") == ("", "Blue!")  # enable_thinking false
    # a marker past the first token of an answer is the model's text, not a part's edge
    assert run([[7, START, 4, END]], start="maybe") == ("", "Blue<think>Hmm</think>")
    # thinking cut by max_tokens: all of it is thinking
    assert run([[START, 4], [5, 6]]) == ("Hmm, sky", "")
    assert run([[4, 5]], start="thinking", parser=R1) == ("Hmm,", "")


def test_reasoning_tokens_count_the_thinking_and_its_markers() -> None:
    split = ThinkingSplit(QWEN3, "maybe", decode)
    for token in OUTPUT:
        split.feed([token], decode([token]))
    assert split.num_reasoning_tokens == OUTPUT.index(END) + 1
    plain = ThinkingSplit(QWEN3, "answer", decode)
    plain.feed([7, 8], "Blue!")
    assert plain.num_reasoning_tokens == 0


def test_start_is_read_off_the_generation_prompt() -> None:
    history = [9, START, 4, END, 7, 9]  # an earlier turn's thinking, then the new turn
    assert QWEN3.start(history, tail=[9, 3]) == "maybe"  # Qwen3's "<|im_start|>assistant\n"
    assert QWEN3.start(history, tail=[START, 3, 3, END, 3, 3]) == "answer"  # thinking off
    assert QWEN3.start(history, tail=[START, 3]) == "thinking"  # Qwen3-Thinking, R1 0528
    assert R1.start(history, tail=[9]) == "thinking"  # R1 that thinks unprompted
    # no generation prompt (a continued final message): the prompt's last marker
    assert QWEN3.start(history, tail=None) == "answer"
    assert QWEN3.start([9, START, 4], tail=None) == "thinking"


def test_the_grammar_starts_after_the_thinking() -> None:
    json = StructuredOutput(kind="json_object")
    assert QWEN3.gate(json, "answer") == json
    assert QWEN3.gate(None, "thinking") is None
    thinking = QWEN3.gate(json, "thinking")
    assert thinking is not None and (thinking.think_end_id, thinking.think_start_id) == (END, None)
    maybe = QWEN3.gate(json, "maybe")
    assert maybe is not None and (maybe.think_end_id, maybe.think_start_id) == (END, START)
    # what the grammar has taken of an output
    assert thinking.constrained([4, 5]) is None
    assert thinking.constrained([4, END, 7]) == [7]
    assert maybe.constrained([]) == [] and maybe.constrained([7, 8]) == [7, 8]
    assert maybe.constrained([START, 4]) is None
    assert maybe.constrained([START, 4, END]) == []


def test_parser_from_the_chat_template(tmp_path: Path, model_dir: Path) -> None:
    deepseek = "{{ '<｜Assistant｜>' }}{% if add_generation_prompt %}<think>\n{% endif %}"
    assert detect(QWEN3_TEMPLATE) == "qwen3"
    assert detect(deepseek) == "deepseek_r1"
    assert detect("{{ '<|im_start|>' }}") is None  # no thinking markers
    assert detect("<think></think> {{ x }}") is None  # markers, family unknown: ambiguous
    plain = Tokenizer.from_dir(model_dir)  # no <think> token
    assert parser_of("auto", plain) is None and parser_of("none", plain) is None
    with pytest.raises(PdserveError, match="single tokens"):
        parser_of("qwen3", plain)
    with pytest.raises(PdserveError, match="one of qwen3, deepseek_r1"):
        parser_of("qwen", plain)
    thinking = Tokenizer.from_dir(thinking_tokenizer(tmp_path / "tok", model_dir))
    parser = parser_of("auto", thinking)
    assert parser is not None and parser.name == "qwen3" and not parser.thinks_unprompted
    assert thinking.decode([parser.start_id, parser.end_id]) == "<think></think>"


def test_vllm_names_of_the_think_parser(tmp_path: Path, model_dir: Path) -> None:
    """vLLM's --reasoning-parser names for models that think between <think> and </think>
    (DeepSeek-V4 / V4.1 as their chat encoders write it) are all this one parser."""
    from pdserve.common.runtime.service_config import REASONING_PARSERS

    assert set(THINKS_UNPROMPTED) == set(REASONING_PARSERS) - {"auto", "none"}
    thinking = Tokenizer.from_dir(thinking_tokenizer(tmp_path / "tok", model_dir))
    for name in ("deepseek_v3", "deepseek_v31", "deepseek_v4", "deepseek_v41"):
        parser = parser_of(name, thinking)
        assert parser is not None and parser.name == name
        assert thinking.decode([parser.start_id, parser.end_id]) == "<think></think>"
        assert not parser.thinks_unprompted  # they think when the prompt opens the thinking
    v4 = parser_of("deepseek_v4", thinking)
    assert v4 is not None
    # DeepSeek-V4's generation prompts: thinking mode, chat mode, neither (a first <think>)
    assert v4.start([], thinking.encode("<｜Assistant｜><think>", False)) == "thinking"
    assert v4.start([], thinking.encode("<｜Assistant｜></think>", False)) == "answer"
    assert v4.start([], thinking.encode("<｜Assistant｜>", False)) == "maybe"


def test_template_reads_a_name_not_a_word() -> None:
    assert template_reads_key(QWEN3_TEMPLATE, "reasoning_content")
    assert not template_reads(QWEN3_TEMPLATE, "reasoning_effort")
    assert template_reads("{%- if reasoning_effort is defined %}", "reasoning_effort")
    assert not template_reads("{{ my_reasoning_effort }}", "reasoning_effort")
    assert template_reads_key("{{ m['reasoning'] }}", "reasoning")
    assert template_reads_key("{{ m.reasoning }}", "reasoning")
    assert not template_reads_key("{{ m.reasoning_content }}", "reasoning")
    assert not template_reads_key("Think with good reasoning.", "reasoning")


def test_reasoning_parser_is_a_config_key_an_env_variable_and_a_flag(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from pdserve.cli.main import build_parser
    from pdserve.common.runtime.service_config import load_config

    toml = tmp_path / "deploy.toml"
    toml.write_text('reasoning_parser = "deepseek_r1"\n')
    assert load_config(toml).reasoning_parser == "deepseek_r1"
    monkeypatch.setenv("PDSERVE_REASONING_PARSER", "none")
    assert load_config(toml).reasoning_parser == "none"  # env over file
    assert load_config(toml, reasoning_parser="qwen3").reasoning_parser == "qwen3"  # flag over env
    assert load_config(None, reasoning_parser="deepseek_v41").reasoning_parser == "deepseek_v41"
    with pytest.raises(PdserveError, match="must be one of auto, none, qwen3"):
        load_config(None, reasoning_parser="deepseek-v4")  # SGLang's spelling, not vLLM's
    args = build_parser().parse_args(["up", "--reasoning-parser", "qwen3"])
    assert args.reasoning_parser == "qwen3"
