"""Random-weight checkpoints of the benchmark shapes (``SHAPES``: Llama 1b/8b, Qwen3-MoE
30b-a3b, DeepSeek-V3's attention), written tensor by tensor without transformers' model
classes so that big ones are fast (``pdserve bench engine --shape``,
``random_shape_model``); tokenizer and special tokens as in common/model/random.py.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pdserve.common.model.files import cache_root, resolve_model
from pdserve.common.model.random import copy_tokenizer, special_token_ids, tokenizer_vocab_size

# Model shapes for benchmarks (``pdserve bench engine --shape``): Llama 3.2 1B's and Llama 3.1
# 8B's layers, heads and MLP, with the embedded tokenizer's vocabulary; ``dsv3``: DeepSeek-V3's
# attention (hidden 7168, 128 heads, q_lora 1536, kv_lora 512, rope 64, nope 128, v 128, its
# yarn rope) on 4 dense layers with a small MLP; ``30b-a3b``: Qwen3-30B-A3B's layer (128
# experts of 768, 8 a token, hidden 2048, 32 heads, 4 KV heads of 128) in 4 layers.
SHAPES: dict[str, dict[str, Any]] = {
    "30b-a3b": dict(
        num_layers=4,
        hidden_size=2048,
        num_heads=32,
        num_kv_heads=4,
        head_dim=128,
        intermediate_size=6144,
        num_experts=128,
        num_experts_per_tok=8,
        moe_intermediate_size=768,
    ),
    "1b": dict(
        num_layers=16, hidden_size=2048, num_heads=32, num_kv_heads=8, intermediate_size=8192
    ),
    "8b": dict(
        num_layers=32, hidden_size=4096, num_heads=32, num_kv_heads=8, intermediate_size=14336
    ),
    "dsv3": dict(
        num_layers=4,
        hidden_size=7168,
        num_heads=128,
        intermediate_size=2048,
        q_lora_rank=1536,
        kv_lora_rank=512,
        qk_rope_head_dim=64,
        qk_nope_head_dim=128,
        v_head_dim=128,
    ),  # fmt: skip
    # dsv3's per-head attention (kv_lora 512, rope 64, nope 128, v 128) at 16 heads, hidden
    # 1024, 2 layers: small enough to profile MLA prefill on a CPU against transformers
    "dsv3-mini": dict(
        num_layers=2,
        hidden_size=1024,
        num_heads=16,
        intermediate_size=1024,
        q_lora_rank=384,
        kv_lora_rank=512,
        qk_rope_head_dim=64,
        qk_nope_head_dim=128,
        v_head_dim=128,
    ),  # fmt: skip
}
# DeepSeek-V3's rope: yarn, factor 40 over 4096 positions, mscale = mscale_all_dim = 1
DSV3_ROPE = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 40.0,
    "original_max_position_embeddings": 4096,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
    "beta_fast": 32,
    "beta_slow": 1,
}


def _draws(dtype: Any, device: str, seed: int) -> tuple[Callable[..., Any], Callable[[int], Any]]:
    """(weight(*shape), ones(n)) of a random checkpoint: N(0, 0.02) drawn on ``device`` from
    ``seed`` in fp32, stored in ``dtype`` on the CPU; norms at one."""
    import torch

    gen = torch.Generator(device=device).manual_seed(seed)

    def weight(*shape: int) -> torch.Tensor:
        w = torch.randn(*shape, generator=gen, device=device, dtype=torch.float32) * 0.02
        return w.to(dtype).cpu()

    def ones(n: int) -> torch.Tensor:
        return torch.ones(n, dtype=dtype)

    return weight, ones


def _dense_mlp(p: str, weight: Callable[..., Any], hidden: int, inter: int) -> dict[str, Any]:
    return {
        p + "mlp.gate_proj.weight": weight(inter, hidden),
        p + "mlp.up_proj.weight": weight(inter, hidden),
        p + "mlp.down_proj.weight": weight(hidden, inter),
    }


def _layer_norms(p: str, ones: Callable[[int], Any], hidden: int) -> dict[str, Any]:
    return {
        p + "input_layernorm.weight": ones(hidden),
        p + "post_attention_layernorm.weight": ones(hidden),
    }


def write_random_llama(
    path: str | os.PathLike[str],
    *,
    num_layers: int,
    hidden_size: int,
    num_heads: int,
    num_kv_heads: int,
    intermediate_size: int,
    head_dim: int | None = None,
    num_experts: int = 0,
    num_experts_per_tok: int = 0,
    moe_intermediate_size: int = 0,
    max_position_embeddings: int = 16384,
    dtype: str = "bfloat16",
    device: str = "cpu",
    seed: int = 0,
    tokenizer_from: str | os.PathLike[str] | None = None,
) -> Path:
    """A random Llama checkpoint (HF names and config.json, no transformers model built)
    written tensor by tensor: weights are drawn on ``device``, so an 8B shape takes seconds
    on a GPU. transformers loads it like any Llama (HF reference columns use it). With
    ``num_experts`` a Qwen3-MoE instead: every layer sparse, q/k norms, per-expert tensors
    named as ``save_pretrained`` writes them."""
    import torch
    from safetensors.torch import save_file

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    source = resolve_model(tokenizer_from)
    vocab = tokenizer_vocab_size(source)
    head_dim = head_dim or hidden_size // num_heads
    torch_dtype = getattr(torch, dtype)
    weight, ones = _draws(torch_dtype, device, seed)

    state = {
        "model.embed_tokens.weight": weight(vocab, hidden_size),
        "model.norm.weight": ones(hidden_size),
        "lm_head.weight": weight(vocab, hidden_size),
    }
    for i in range(num_layers):
        p = f"model.layers.{i}."
        state[p + "self_attn.q_proj.weight"] = weight(num_heads * head_dim, hidden_size)
        state[p + "self_attn.k_proj.weight"] = weight(num_kv_heads * head_dim, hidden_size)
        state[p + "self_attn.v_proj.weight"] = weight(num_kv_heads * head_dim, hidden_size)
        state[p + "self_attn.o_proj.weight"] = weight(hidden_size, num_heads * head_dim)
        if num_experts:
            state.update(_random_moe_layer(p, weight, ones, hidden_size, head_dim, num_experts))
            state.update(
                (f"{p}mlp.experts.{e}.{name}", weight(*shape))
                for e in range(num_experts)
                for name, shape in (
                    ("gate_proj.weight", (moe_intermediate_size, hidden_size)),
                    ("up_proj.weight", (moe_intermediate_size, hidden_size)),
                    ("down_proj.weight", (hidden_size, moe_intermediate_size)),
                )
            )
        else:
            state.update(_dense_mlp(p, weight, hidden_size, intermediate_size))
        state.update(_layer_norms(p, ones, hidden_size))
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab,
        "hidden_size": hidden_size,
        "intermediate_size": intermediate_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": head_dim,
        "max_position_embeddings": max_position_embeddings,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "tie_word_embeddings": False,
        "torch_dtype": dtype,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        **special_token_ids(source),
    }
    if num_experts:
        config.update(
            architectures=["Qwen3MoeForCausalLM"],
            model_type="qwen3_moe",
            num_experts=num_experts,
            num_experts_per_tok=num_experts_per_tok,
            moe_intermediate_size=moe_intermediate_size,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[],
        )
    (out / "config.json").write_text(json.dumps(config, indent=1))
    copy_tokenizer(source, out)
    return out


def _random_moe_layer(
    prefix: str, weight: Any, ones: Any, hidden_size: int, head_dim: int, num_experts: int
) -> dict[str, Any]:
    """A Qwen3-MoE layer's router and q/k norms (its experts are written by the caller)."""
    return {
        prefix + "mlp.gate.weight": weight(num_experts, hidden_size),
        prefix + "self_attn.q_norm.weight": ones(head_dim),
        prefix + "self_attn.k_norm.weight": ones(head_dim),
    }


def random_shape_model(
    shape: str,
    *,
    num_layers: int | None = None,
    device: str = "cpu",
    dtype: str = "bfloat16",
    tokenizer_from: str | os.PathLike[str] | None = None,
) -> Path:
    """The checkpoint of a named shape (``SHAPES``), written once into the model cache."""
    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}: expected one of {', '.join(SHAPES)}")
    dims = dict(SHAPES[shape])
    if num_layers is not None:
        dims["num_layers"] = num_layers
    family = (
        "deepseek" if "kv_lora_rank" in dims else "qwen3moe" if dims.get("num_experts") else "llama"
    )
    path = cache_root() / "random" / f"{family}-{shape}-{dims['num_layers']}l-{dtype}"
    if not (path / "model.safetensors").is_file():
        tmp = path.with_name(path.name + f".tmp{os.getpid()}")
        write = write_random_deepseek if family == "deepseek" else write_random_llama
        write(tmp, **dims, dtype=dtype, device=device, tokenizer_from=tokenizer_from)
        tmp.replace(path)
    return path


def write_random_deepseek(
    path: str | os.PathLike[str],
    *,
    num_layers: int,
    hidden_size: int,
    num_heads: int,
    intermediate_size: int,
    q_lora_rank: int,
    kv_lora_rank: int,
    qk_rope_head_dim: int,
    qk_nope_head_dim: int,
    v_head_dim: int,
    max_position_embeddings: int = 16384,
    dtype: str = "bfloat16",
    device: str = "cpu",
    seed: int = 0,
    tokenizer_from: str | os.PathLike[str] | None = None,
) -> Path:
    """A random dense DeepseekV3ForCausalLM checkpoint (HF names, config.json with
    first_k_dense_replace = num_layers) written tensor by tensor, as write_random_llama."""
    import torch
    from safetensors.torch import save_file

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    source = resolve_model(tokenizer_from)
    vocab = tokenizer_vocab_size(source)
    torch_dtype = getattr(torch, dtype)
    weight, ones = _draws(torch_dtype, device, seed)

    qk = qk_nope_head_dim + qk_rope_head_dim
    state = {
        "model.embed_tokens.weight": weight(vocab, hidden_size),
        "model.norm.weight": ones(hidden_size),
        "lm_head.weight": weight(vocab, hidden_size),
    }
    for i in range(num_layers):
        p = f"model.layers.{i}."
        state[p + "self_attn.q_a_proj.weight"] = weight(q_lora_rank, hidden_size)
        state[p + "self_attn.q_a_layernorm.weight"] = ones(q_lora_rank)
        state[p + "self_attn.q_b_proj.weight"] = weight(num_heads * qk, q_lora_rank)
        state[p + "self_attn.kv_a_proj_with_mqa.weight"] = weight(
            kv_lora_rank + qk_rope_head_dim, hidden_size
        )
        state[p + "self_attn.kv_a_layernorm.weight"] = ones(kv_lora_rank)
        state[p + "self_attn.kv_b_proj.weight"] = weight(
            num_heads * (qk_nope_head_dim + v_head_dim), kv_lora_rank
        )
        state[p + "self_attn.o_proj.weight"] = weight(hidden_size, num_heads * v_head_dim)
        state.update(_dense_mlp(p, weight, hidden_size, intermediate_size))
        state.update(_layer_norms(p, ones, hidden_size))
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "vocab_size": vocab,
        "hidden_size": hidden_size,
        "intermediate_size": intermediate_size,
        "num_hidden_layers": num_layers,
        "first_k_dense_replace": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_heads,
        "q_lora_rank": q_lora_rank,
        "kv_lora_rank": kv_lora_rank,
        "qk_rope_head_dim": qk_rope_head_dim,
        "qk_nope_head_dim": qk_nope_head_dim,
        "v_head_dim": v_head_dim,
        "rope_interleave": True,
        "rope_scaling": DSV3_ROPE,
        "max_position_embeddings": max_position_embeddings,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "torch_dtype": dtype,
        "hidden_act": "silu",
        "attention_bias": False,
        **special_token_ids(source),
    }
    (out / "config.json").write_text(json.dumps(config, indent=1))
    copy_tokenizer(source, out)
    return out
