from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from pdserve.common.errors import ModelLoadError, PdserveError
from pdserve.common.model.checkpoint.tokenizer import IncrementalDetokenizer, Tokenizer

TEXTS = [
    "",
    "Hello, world!",
    " leading space",
    "trailing space ",
    "tabs\tand\nnew\n\nlines\r\n",
    "     many      spaces     ",
    "naïve café, Straße, ÆØÅ",
    "日本語のテキストと中文",
    "emoji 🙂👍🏽 and 👨‍👩‍👧‍👦 family",
    "def f(x):\n    return {'a': [x ** 2, None]}  # comment",
    "<|im_start|>user\nhi<|im_end|>",
    "mixed<|endoftext|>special",
    "Здравствуйте, мир! مرحبا بالعالم",
    "numbers 1234567890 3.14159 -42",
    "\u200bzero\u200dwidth and combining e\u0301",
]

CONVERSATIONS = [
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi!"}],
    [{"role": "user", "content": "What is 2+2?"}],
    [
        {"role": "system", "content": "Be kind."},
        {"role": "user", "content": "Tell me a joke."},
        {"role": "assistant", "content": "Why did the GPU cross the road?"},
        {"role": "user", "content": "Why? 🙂"},
    ],
    [{"role": "user", "content": "  spaces\n\nand lines  "}, {"role": "assistant", "content": ""}],
]


@pytest.fixture(scope="session")
def tok(model_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(model_dir)


def _dir_with_template(tmp_path: Path, model_dir: Path, template: str | None) -> Path:
    shutil.copyfile(model_dir / "tokenizer.json", tmp_path / "tokenizer.json")
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    config["chat_template"] = template
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    return tmp_path


# -- ids and special tokens --------------------------------------------------------------


def test_special_tokens(tok: Tokenizer, hf_tokenizer: Any) -> None:
    assert tok.vocab_size == len(hf_tokenizer) == 49152
    assert tok.bos_token_id == hf_tokenizer.bos_token_id == 1
    assert tok.pad_token_id == hf_tokenizer.pad_token_id
    assert tok.eos_token_ids == [hf_tokenizer.eos_token_id] == [2]


def test_eos_ids_merge_generation_config(tmp_path: Path, model_dir: Path) -> None:
    directory = _dir_with_template(tmp_path, model_dir, None)
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, 2]}))
    assert Tokenizer.from_dir(directory).eos_token_ids == [2, 0]


@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_match_transformers(tok: Tokenizer, hf_tokenizer: Any, text: str) -> None:
    for special in (True, False):
        ids = tok.encode(text, add_special_tokens=special)
        assert ids == hf_tokenizer.encode(text, add_special_tokens=special)
        for skip in (True, False):
            assert tok.decode(ids, skip_special_tokens=skip) == hf_tokenizer.decode(
                ids, skip_special_tokens=skip
            )


# -- chat template -----------------------------------------------------------------------


@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_chat_template_matches_transformers(
    tok: Tokenizer, hf_tokenizer: Any, messages: list[dict]
) -> None:
    for add_prompt in (True, False):
        expected = hf_tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_prompt
        )
        assert tok.apply_chat_template(messages, add_generation_prompt=add_prompt) == expected
    expected_ids = hf_tokenizer.apply_chat_template(
        messages, tokenize=True, add_generation_prompt=True, return_dict=False
    )
    assert tok.encode_chat(messages) == expected_ids


def test_none_valued_keys_are_dropped(tok: Tokenizer, hf_tokenizer: Any) -> None:
    messages = [{"role": "user", "content": "hi", "name": None}]
    assert tok.apply_chat_template(messages) == hf_tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )


# Templates that exercise the environment transformers sets up: tojson without HTML
# escaping, loop controls, namespace, dict(), the {% generation %} tag, token variables.
CUSTOM_TEMPLATES = [
    "{{ messages | tojson }}{{ messages[0] | tojson(indent=2, sort_keys=True) }}",
    (
        "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}{{ m.content }}\n"
        "{% endfor %}{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}"
        "{% endfor %}{{ ns.n }}"
    ),
    "{{ dict(a=1) | tojson }}{{ bos_token }}|{{ eos_token }}|{{ pad_token }}",
    "{% for m in messages %}{% generation %}{{ m.content }}{% endgeneration %}\n{% endfor %}",
    "  {% if add_generation_prompt %}\n  gen\n  {% endif %}\n{{ messages | length }}",
]


@pytest.mark.parametrize("template", CUSTOM_TEMPLATES)
def test_template_environment_matches_transformers(
    tmp_path: Path, model_dir: Path, hf_tokenizer: Any, template: str
) -> None:
    messages = [
        {"role": "user", "content": "<b>&'\"ü</b>"},
        {"role": "assistant", "content": "ok"},
    ]
    ours = Tokenizer.from_dir(_dir_with_template(tmp_path, model_dir, template))
    expected = hf_tokenizer.apply_chat_template(
        messages, chat_template=template, tokenize=False, add_generation_prompt=True
    )
    assert ours.apply_chat_template(messages) == expected


def test_strftime_now(tmp_path: Path, model_dir: Path) -> None:
    ours = Tokenizer.from_dir(_dir_with_template(tmp_path, model_dir, "{{ strftime_now('%Y') }}"))
    assert ours.apply_chat_template([]).isdigit()


def test_template_exception_becomes_pdserve_error(tmp_path: Path, model_dir: Path) -> None:
    template = (
        "{% if messages[0].role != 'user' %}"
        "{{ raise_exception('Conversations must start with a user turn') }}{% endif %}"
    )
    ours = Tokenizer.from_dir(_dir_with_template(tmp_path, model_dir, template))
    with pytest.raises(PdserveError, match="Conversations must start with a user turn"):
        ours.apply_chat_template([{"role": "assistant", "content": "hi"}])


def test_template_type_error_becomes_pdserve_error(tok: Tokenizer) -> None:
    # OpenAI-style content parts: the SmolLM2 template concatenates content as a string.
    with pytest.raises(PdserveError, match="chat template"):
        tok.apply_chat_template([{"role": "user", "content": [{"type": "text", "text": "hi"}]}])


def test_sandbox_blocks_namespace_dunders(tmp_path: Path, model_dir: Path) -> None:
    template = "{% set ns = namespace() %}{% set ns._x = 1 %}"
    ours = Tokenizer.from_dir(_dir_with_template(tmp_path, model_dir, template))
    with pytest.raises(PdserveError):
        ours.apply_chat_template([])


def test_missing_template(tmp_path: Path, model_dir: Path) -> None:
    ours = Tokenizer.from_dir(_dir_with_template(tmp_path, model_dir, None))
    with pytest.raises(PdserveError, match="no chat template"):
        ours.apply_chat_template([{"role": "user", "content": "hi"}])


def test_chat_template_jinja_file_wins(tmp_path: Path, model_dir: Path) -> None:
    directory = _dir_with_template(tmp_path, model_dir, "from config")
    (directory / "chat_template.jinja").write_text("from file")
    assert Tokenizer.from_dir(directory).apply_chat_template([]) == "from file"


def test_broken_template_fails_at_load(tmp_path: Path, model_dir: Path) -> None:
    with pytest.raises(ModelLoadError, match="does not parse"):
        Tokenizer.from_dir(_dir_with_template(tmp_path, model_dir, "{% for %}"))


def test_missing_tokenizer_json(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="tokenizer.json"):
        Tokenizer.from_dir(tmp_path)


# -- incremental detokenization ----------------------------------------------------------


def _stream(tok: Tokenizer, ids: list[int], skip_special_tokens: bool = True) -> list[str]:
    detok = IncrementalDetokenizer(tok, skip_special_tokens=skip_special_tokens)
    return [detok.add(i) for i in ids] + [detok.flush()]


@pytest.mark.parametrize("text", TEXTS)
def test_incremental_detokenizer_matches_decode(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text)
    for skip in (True, False):
        deltas = _stream(tok, ids, skip)
        assert "".join(deltas) == tok.decode(ids, skip_special_tokens=skip)
        assert deltas[-1] == ""
        assert not any("\ufffd" in d for d in deltas)


def test_incremental_detokenizer_holds_back_partial_characters(tok: Tokenizer) -> None:
    text = "Zoë says 🙂👍🏽 日本語 done"
    ids = tok.encode(text)
    assert any("\ufffd" in tok.decode([i]) for i in ids), "no token splits a character"
    deltas = _stream(tok, ids)
    assert "".join(deltas) == text
    assert "" in deltas[:-1]  # something was held back for a while


def test_incremental_detokenizer_flush_releases_a_trailing_partial_character(
    tok: Tokenizer,
) -> None:
    ids = tok.encode("ok 🙂")
    ids = ids[:-1] if "\ufffd" in tok.decode(ids[:-1]) else ids
    deltas = _stream(tok, ids)
    assert "".join(deltas) == tok.decode(ids)
