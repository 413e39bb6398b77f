"""Tokenizer and chat template without transformers.

transformers takes seconds to import, too slow for the router; the `tokenizers` library
reads the same tokenizer.json, and jinja2 renders the chat template in the sandbox
configuration transformers uses, so prompts come out identical to Hugging Face's.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.meta
import jinja2.nodes
import jinja2.parser
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer

from pdserve.common.errors import ModelLoadError, PdserveError

# The special-token variables transformers hands every chat template.
SPECIAL_TOKEN_NAMES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)
REPLACEMENT_CHAR = "\ufffd"


class Tokenizer:
    def __init__(
        self,
        backend: HFTokenizer,
        special_tokens: dict[str, str],
        chat_template: str | None,
        eos_token_ids: list[int],
    ) -> None:
        self._backend = backend
        self.special_tokens = special_tokens
        self.chat_template = chat_template
        self._template = _compile_template(chat_template) if chat_template else None
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        self.bos_token_id = self._token_id(special_tokens.get("bos_token"))
        self.pad_token_id = self._token_id(special_tokens.get("pad_token"))
        self.eos_token_ids = eos_token_ids

    @functools.cached_property
    def template_variables(self) -> frozenset[str]:
        """The names the chat template reads from its context (jinja2's undeclared
        variables, the ones transformers passes included): which template kwargs it can
        take. vLLM drops a request's kwargs outside this set; the router refuses them."""
        if self._template is None or self.chat_template is None:
            return frozenset()
        tree = self._template.environment.parse(self.chat_template)
        return frozenset(jinja2.meta.find_undeclared_variables(tree))

    @property
    def vocab(self) -> dict[str, int]:
        """Token text -> id, added tokens included (a draft model must share it)."""
        return self._backend.get_vocab(with_added_tokens=True)

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        path = Path(path)
        try:
            backend = HFTokenizer.from_file(str(path / "tokenizer.json"))
        except Exception as exc:  # tokenizers raises a bare Exception for missing or bad files
            raise ModelLoadError(
                f"cannot load {path / 'tokenizer.json'} ({exc}); "
                "the model directory needs a fast tokenizer"
            ) from exc
        config = _read_json(path / "tokenizer_config.json")
        special = {
            name: token
            for name in SPECIAL_TOKEN_NAMES
            if (token := _token_content(config.get(name))) is not None
        }
        eos_ids = _eos_token_ids(
            backend, special.get("eos_token"), _read_json(path / "generation_config.json")
        )
        try:
            return cls(backend, special, _chat_template(path, config), eos_ids)
        except jinja2.TemplateSyntaxError as exc:
            raise ModelLoadError(
                f"the chat template in {path} does not parse ({exc}); fix or remove it"
            ) from exc

    @functools.cached_property
    def longest_token_chars(self) -> int:
        """The most characters one token covers (its string's length, which counts bytes
        for byte-level BPE): a text longer than ``n`` times this has more than ``n`` tokens."""
        return max((len(t) for t in self._backend.get_vocab(with_added_tokens=True)), default=1)

    def _token_id(self, token: str | None) -> int | None:
        return None if token is None else self._backend.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_plain(self, text: str) -> list[int]:
        """``text``'s ids with every special token's text in it taken as plain text (as
        any other characters), never as the control token; no BOS or EOS added."""
        return self._plain_backend.encode(text, add_special_tokens=False).ids

    @functools.cached_property
    def _plain_backend(self) -> HFTokenizer:
        plain = HFTokenizer.from_str(self._backend.to_str())
        plain.encode_special_tokens = True  # special added tokens are not split out
        return plain

    @functools.cached_property
    def special_token_texts(self) -> tuple[str, ...]:
        """The texts of the special tokens (the added tokens marked special)."""
        decoder = self._backend.get_added_tokens_decoder()
        return tuple(sorted({t.content for t in decoder.values() if t.special and t.content}))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        ids = ids if type(ids) is list else list(ids)  # the detokenizer's windows: lists
        return self._backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        template_kwargs: dict[str, Any] | None = None,
        tools: list[Any] | None = None,
    ) -> str:
        """``template_kwargs``: extra template variables (vLLM's chat_template_kwargs, e.g.
        enable_thinking); they cannot replace the messages or the special tokens.
        ``tools``: OpenAI's tool list, which the template shows the model (transformers'
        ``tools``)."""
        if self._template is None:
            raise PdserveError(
                "this model has no chat template; send a raw prompt (a completion request) instead"
            )
        # Like transformers: an absent key and a None value (OpenAI's content=None) are
        # the same thing to a template, and many templates only handle the former.
        chat = [{k: v for k, v in message.items() if v is not None} for message in messages]
        variables = {
            **(template_kwargs or {}),
            "messages": chat,
            "tools": tools,
            "documents": None,
            "add_generation_prompt": add_generation_prompt,
            **self.special_tokens,
        }
        try:
            return self._template.render(**variables)
        except (jinja2.TemplateError, TypeError, ValueError) as exc:
            message = " ".join(str(exc).split()) or type(exc).__name__
            raise PdserveError(f"the chat template rejected the messages: {message}") from exc

    def encode_chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        template_kwargs: dict[str, Any] | None = None,
    ) -> list[int]:
        # The template already wrote BOS and friends as text; adding them again would double them.
        text = self.apply_chat_template(messages, add_generation_prompt, template_kwargs)
        return self.encode(text, add_special_tokens=False)


class IncrementalDetokenizer:
    """Text deltas for a stream of token ids.

    Decoding each token alone breaks multi-byte characters split across tokens and
    tokenizers that drop a leading space; decoding everything each step is quadratic.
    So, as vLLM does, decode a short window: the last emitted tokens (for context) plus
    the new ones, and emit what the new ones added once it no longer ends in U+FFFD.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._ids: list[int] = []
        self._prefix_offset = 0  # start of the context window
        self._read_offset = 0  # tokens before this are emitted

    def add(self, token_id: int) -> str:
        """The text ``token_id`` completes; "" while it ends in a partial character."""
        self._ids.append(token_id)
        prefix_text = self._decode(self._prefix_offset, self._read_offset)
        new_text = self._decode(self._prefix_offset, len(self._ids))
        if len(new_text) <= len(prefix_text) or new_text.endswith(REPLACEMENT_CHAR):
            return ""
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        return new_text[len(prefix_text) :]

    def flush(self) -> str:
        """What is still held back, at the end of the stream: a trailing U+FFFD is then final."""
        prefix_text = self._decode(self._prefix_offset, self._read_offset)
        new_text = self._decode(self._prefix_offset, len(self._ids))
        self._prefix_offset = self._read_offset = len(self._ids)
        return new_text[len(prefix_text) :]

    def _decode(self, start: int, end: int) -> str:
        return self._tokenizer.decode(self._ids[start:end], skip_special_tokens=self._skip_special)


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot read {path} ({exc}); fix or remove the file") from exc


def _token_content(token: Any) -> str | None:
    # tokenizer_config.json spells a token as a string or as a serialized AddedToken.
    return token.get("content") if isinstance(token, dict) else token


def _eos_token_ids(
    backend: HFTokenizer, eos_token: str | None, generation_config: dict[str, Any]
) -> list[int]:
    """EOS ids from the tokenizer and generation_config.json (Llama 3 Instruct lists several)."""
    ids: list[int] = []
    if eos_token is not None and (token_id := backend.token_to_id(eos_token)) is not None:
        ids.append(token_id)
    extra = generation_config.get("eos_token_id")
    for token_id in extra if isinstance(extra, list) else [extra]:
        if isinstance(token_id, int) and token_id not in ids:
            ids.append(token_id)
    return ids


def _chat_template(path: Path, config: dict[str, Any]) -> str | None:
    """The default chat template; as in transformers, chat_template.jinja wins over
    tokenizer_config.json."""
    jinja_file = path / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    return template or None


# -- the jinja2 environment transformers renders chat templates in ------------------------


class _GenerationTag(jinja2.ext.Extension):
    """Accept {% generation %}...{% endgeneration %}, which transformers uses to mark
    assistant tokens for training masks; at inference it renders its body unchanged."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


class _TemplateDict:
    """dict() for templates without the type itself, which would allow type-hackery."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """namespace() that refuses underscore attributes, the way into CPython internals."""

    def __init__(
        *args: Any, **kwargs: Any
    ) -> None:  # Namespace's own trick: allows namespace(self=...)
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"chat templates cannot set the attribute {name!r}"
            )


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's own tojson HTML-escapes, which would change the prompt.
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _compile_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    return env.from_string(source)
