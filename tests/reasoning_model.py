"""A reasoning model for tests, built offline: the embedded model's tokenizer (ChatML, as
Qwen's) with Qwen3's ``<think>`` and ``</think>`` added as Qwen3 has them (added tokens,
not special), Qwen3's own chat template, and a random Qwen3 checkpoint whose greedy
output is steered through the thinking markers.

QWEN3_TEMPLATE is Qwen3's chat template as Qwen/Qwen3-0.6B ships it (Apache-2.0), in
tests/data/qwen3_chat_template.jinja.

The steering is in the weights: each token of ``CHAIN`` gets a one-hot embedding (its own
axis of the hidden space) and its successor an LM-head row along that axis, so the
logit of the successor of the last token dwarfs every other (~40 against ~1) whatever
the random layers add. After Qwen3's generation prompt (``<|im_start|>assistant\\n``) the
model thinks ``<think>Let me see</think>`` and answers ``\\n\\nBlue!``; after the prompt
that turns thinking off (``...</think>\\n\\n``) it answers ``Blue!`` at once.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

TEMPLATE_PATH = Path(__file__).with_name("data") / "qwen3_chat_template.jinja"
QWEN3_TEMPLATE = TEMPLATE_PATH.read_text(encoding="utf-8").rstrip("\n")
NEWLINE, TWO_NEWLINES, EOS = 198, 1116, 2  # "\n", "\n\n", <|im_end|> of the embedded tokenizer
THINKING, ANSWER = "Let me see", "\n\nBlue!"
SCALE = 5.0  # the successor's logit: SCALE x sqrt(hidden) on a one-hot embedding


def thinking_tokenizer(out: Path, source: Path) -> Path:
    """``source``'s tokenizer plus ``<think>``/``</think>`` (ids after its vocabulary) and
    Qwen3's chat template, written to ``out``."""
    from tokenizers import AddedToken, Tokenizer

    out.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer.from_file(str(source / "tokenizer.json"))
    tokenizer.add_tokens([AddedToken(m, special=False, normalized=False)
                          for m in ("<think>", "</think>")])  # fmt: skip
    tokenizer.save(str(out / "tokenizer.json"))
    config = json.loads((source / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    (out / "chat_template.jinja").write_text(QWEN3_TEMPLATE, encoding="utf-8")
    shutil.copyfile(source / "generation_config.json", out / "generation_config.json")  # EOS
    return out


def chain(tokenizer_dir: Path) -> dict[int, int]:
    """token -> the token the steered model answers it with."""
    from pdserve.common.model.checkpoint.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(tokenizer_dir)
    words = [tok.encode(w, add_special_tokens=False) for w in ("Let", " me", " see", "Blue", "!")]
    assert all(len(w) == 1 for w in words), words
    let, me, see, blue, bang = (w[0] for w in words)
    start, end = tok.vocab["<think>"], tok.vocab["</think>"]
    return {NEWLINE: start, start: let, let: me, me: see, see: end, end: TWO_NEWLINES,
            TWO_NEWLINES: blue, blue: bang, bang: EOS}  # fmt: skip


def steered_qwen3(out: Path, source: Path) -> Path:
    """A random 2-layer Qwen3 (hidden 64) with ``source``'s tokenizer made a thinking one
    (``thinking_tokenizer``), steered along ``chain``."""
    import torch
    from safetensors.torch import load_file, save_file

    from pdserve.common.model.fixtures.random import save_random_model, tokenizer_vocab_size

    path = save_random_model(
        out, "qwen3", tokenizer_from=source, vocab_size=tokenizer_vocab_size(source) + 2,
        hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        max_position_embeddings=2048, tie_word_embeddings=False, seed=0,
    )  # fmt: skip
    thinking_tokenizer(path, source)
    weights = load_file(str(path / "model.safetensors"))
    embed, head = weights["model.embed_tokens.weight"], weights["lm_head.weight"]  # [V, 64]
    for axis, (token, successor) in enumerate(chain(path).items()):
        embed[token] = torch.nn.functional.one_hot(torch.tensor(axis), embed.shape[1])
        head[successor] = SCALE * embed[token]
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path
