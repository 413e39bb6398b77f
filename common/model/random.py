"""Random-weight checkpoints of any family, for tests: ``save_random_model`` /
``save_random_llama`` build them with transformers' own classes (the reference for tests),
``save_random_v4`` a small DeepSeek-V4 with every kind of layer (tests, `pdserve bench
accuracy --random deepseek_v4`);
common/model/random_shapes.py writes big ones fast for benchmarks (``random_shape_model``).

They reuse a real tokenizer so that prompts, chat templates and detokenization behave as
with a real model; only the weights (and so the generated text) are noise.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

from pdserve.common.model.files import resolve_model

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "special_tokens_map.json",
)


def save_random_llama(
    path: str | os.PathLike[str],
    *,
    num_layers: int = 2,
    hidden_size: int = 128,
    num_heads: int = 8,
    num_kv_heads: int = 4,
    intermediate_size: int = 256,
    vocab_size: int | None = None,
    max_position_embeddings: int = 2048,
    seed: int = 0,
    rope_scaling: dict[str, Any] | None = None,
    sliding_window: int | None = None,
    tokenizer_from: str | os.PathLike[str] | None = None,
) -> Path:
    """Write a random LlamaForCausalLM (float32 safetensors) plus a tokenizer into ``path``;
    with ``sliding_window`` a MistralForCausalLM (the same weights, every layer windowed):
    transformers' Llama ignores sliding_window, and so does pdserve."""
    window = {"sliding_window": sliding_window} if sliding_window else {}
    return save_random_model(
        path,
        "mistral" if sliding_window else "llama",
        seed=seed,
        tokenizer_from=tokenizer_from,
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        rope_scaling=rope_scaling,
        tie_word_embeddings=False,
        **window,
    )


def save_random_model(
    path: str | os.PathLike[str],
    model_type: str,
    *,
    seed: int = 0,
    tokenizer_from: str | os.PathLike[str] | None = None,
    vocab_size: int | None = None,
    **config: Any,
) -> Path:
    """Write a random checkpoint of transformers' own classes for ``model_type`` (its
    config class with ``config`` as keyword arguments, its ForCausalLM), float32
    safetensors, plus the tokenizer of ``tokenizer_from`` (default: the embedded model)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    out = Path(path)
    source = resolve_model(tokenizer_from)
    hf_config = AutoConfig.for_model(
        model_type,
        vocab_size=vocab_size or tokenizer_vocab_size(source),
        **special_token_ids(source),
        **config,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config).to(torch.float32).eval()
    model.save_pretrained(out, safe_serialization=True)
    copy_tokenizer(source, out)
    return out


# A small DeepSeek-V4 with every kind of attention layer (sliding, CSA with entries of 4 and
# an indexer keeping 6, HCA with entries of 16), hash_moe and moe layers, 4 streams.
RANDOM_V4: dict[str, Any] = {
    "hidden_size": 64,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "head_dim": 32,
    "q_lora_rank": 32,
    "partial_rotary_factor": 0.25,  # rope over the last 8 of 32
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "layer_types": [
        "sliding_attention",
        "compressed_sparse_attention",
        "heavily_compressed_attention",
        "compressed_sparse_attention",
    ],
    "mlp_layer_types": ["hash_moe", "hash_moe", "moe", "moe"],
    "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 16},
    "hc_mult": 4,
    "sliding_window": 16,
    "o_groups": 2,
    "o_lora_rank": 16,
    "index_n_heads": 8,
    "index_head_dim": 16,
    "index_topk": 6,
}
# initialised to zero (or one value) by transformers: drawn, so that each path matters
V4_DRAWN = ("sinks", "position_bias", "e_score_correction_bias", "base", "hc_base")


def save_random_v4(
    path: str | os.PathLike[str],
    *,
    seed: int = 1,
    tokenizer_from: str | os.PathLike[str] | None = None,
    **overrides: Any,
) -> Path:
    """Write a random ``DeepseekV4ForCausalLM`` of ``RANDOM_V4`` (with ``overrides``) by
    transformers' own classes, its hash-routing table and the ``V4_DRAWN`` parameters
    drawn at random too, plus the tokenizer of ``tokenizer_from`` (default: embedded)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    out = Path(path)
    source = resolve_model(tokenizer_from)
    config = AutoConfig.for_model(
        "deepseek_v4",
        vocab_size=tokenizer_vocab_size(source),
        max_position_embeddings=4096,
        **special_token_ids(source),
        **{**RANDOM_V4, **overrides},
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).to(torch.float32).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            if name.endswith("tid2eid"):
                experts = config.n_routed_experts
                tensor.copy_(torch.randint(0, experts, tensor.shape, generator=gen))
            elif name.endswith(V4_DRAWN):
                tensor.copy_(torch.randn(tensor.shape, generator=gen) * 0.5)
    model.save_pretrained(out, safe_serialization=True)
    copy_tokenizer(source, out)
    return out


def tokenizer_vocab_size(model_dir: Path) -> int:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(model_dir / "tokenizer.json")).get_vocab_size(
        with_added_tokens=True
    )


def special_token_ids(model_dir: Path) -> dict[str, Any]:
    """bos/eos/pad ids of the source model, so the random one stops on the same tokens."""
    config = json.loads((model_dir / "config.json").read_text())
    return {
        k: config[k]
        for k in ("bos_token_id", "eos_token_id", "pad_token_id")
        if config.get(k) is not None
    }


def copy_tokenizer(source: Path, out: Path) -> None:
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copyfile(source / name, out / name)
