"""Random-weight checkpoints of the benchmark shapes (``SHAPES``: Llama 1b/8b, Qwen3-MoE
30b-a3b, DeepSeek-V3's attention; ``CONFIG_SHAPES``: Qwen3-30B-A3B and DeepSeek-V2-Lite at
full depth, DeepSeek-V3.2's and V4-Flash's layers), written tensor by tensor without transformers' model
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
    """The checkpoint of a named shape (``SHAPES``, ``CONFIG_SHAPES``), written once into
    the model cache."""
    if shape in CONFIG_SHAPES:
        raw = shape_config(shape, num_layers)
        name = f"{raw['model_type']}-{shape}-{raw['num_hidden_layers']}l-{dtype}-zero-experts"
        path = cache_root() / "random" / name
        if not path.is_dir():  # renamed into place whole
            tmp = path.with_name(path.name + f".tmp{os.getpid()}")
            write_random_shape(tmp, raw, dtype=dtype, device=device, tokenizer_from=tokenizer_from)
            tmp.replace(path)
        return path
    if shape not in SHAPES:
        names = ", ".join([*SHAPES, *CONFIG_SHAPES])
        raise ValueError(f"unknown shape {shape!r}: expected one of {names}")
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


# -- shapes written from their config alone ---------------------------------------------------
#
# The shapes below are written by ``write_random_shape``: config.json as transformers reads
# it, then every tensor the pdserve model of that config holds (names and shapes read off
# the model built on the meta device: what the loader will ask for), streamed one tensor at
# a time into one safetensors file per layer with transformers' index. The routed experts
# are written as zeros, holes of a sparse file: a checkpoint of Qwen3-30B-A3B's 48 layers is
# 61 GB of which 58 GB are experts, which neither the benchmark machine's disk nor its time
# budget holds. A decode step reads and multiplies zeros at the speed of any value, and the
# routers, attention and embeddings stay random, so which experts tokens choose (what a step
# reads) is as spread as with random experts. Each is sized to fit one 80 GB GPU in bf16
# (``shape_bytes`` counts it; tests/test_random_shapes.py checks the fit, and that
# transformers and the engine load a tiny one alike).

# Qwen3-30B-A3B at full depth: 48 layers of 128 experts of 768, 8 a token.
QWEN3_30B_A3B_FULL: dict[str, Any] = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "num_hidden_layers": 48,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "moe_intermediate_size": 768,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "max_position_embeddings": 16384,
    "tie_word_embeddings": False,
}

# DeepSeek-V2-Lite's sizes, all 27 layers (hidden 2048, 16 heads, no q compression, kv_lora
# 512, rope 64 / nope 128 / v 128, layer 0 dense of 10944, then 64 experts of 1408, 6 a
# token, 2 shared), on DeepSeek-V3's code: pdserve routes V3's experts, not V2's softmax
# routing; the bytes a step reads and the kernels that read them are the same.
DEEPSEEK_V2_LITE: dict[str, Any] = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "hidden_size": 2048,
    "intermediate_size": 10944,
    "num_hidden_layers": 27,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "q_lora_rank": None,
    "kv_lora_rank": 512,
    "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 128,
    "v_head_dim": 128,
    "n_routed_experts": 64,
    "num_experts_per_tok": 6,
    "moe_intermediate_size": 1408,
    "n_shared_experts": 2,
    "first_k_dense_replace": 1,
    "n_group": 1,
    "topk_group": 1,
    "routed_scaling_factor": 1.0,
    "norm_topk_prob": False,
    "rope_interleave": True,
    "rope_scaling": {**DSV3_ROPE, "mscale": 0.707, "mscale_all_dim": 0.707},
    "max_position_embeddings": 16384,
    "rms_norm_eps": 1e-6,
    "num_nextn_predict_layers": 0,
    "tie_word_embeddings": False,
}

# DeepSeek-V3.2's layers: V3's MLA (hidden 7168, 128 heads, q_lora 1536, kv_lora 512) with the
# lightning indexer (64 heads x 128, top 2048), a dense layer of 18432 then MoE layers of 256
# experts of 2048, 8 a token in 4 of 8 groups, 1 shared. 4 layers (1 dense, 3 MoE: 67 GiB in
# bf16 with the embedded tokenizer's vocabulary) fit one 80 GB GPU; 5 (88 GiB) would not.
DEEPSEEK_V32: dict[str, Any] = {
    "architectures": ["DeepseekV32ForCausalLM"],
    "model_type": "deepseek_v32",
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "num_hidden_layers": 4,
    "num_attention_heads": 128,
    "num_key_value_heads": 128,
    "q_lora_rank": 1536,
    "kv_lora_rank": 512,
    "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 128,
    "v_head_dim": 128,
    "n_routed_experts": 256,
    "num_experts_per_tok": 8,
    "moe_intermediate_size": 2048,
    "n_shared_experts": 1,
    "first_k_dense_replace": 1,
    "n_group": 8,
    "topk_group": 4,
    "routed_scaling_factor": 2.5,
    "norm_topk_prob": True,
    "index_n_heads": 64,
    "index_head_dim": 128,
    "index_topk": 2048,
    "rope_interleave": True,
    "rope_scaling": DSV3_ROPE,
    "max_position_embeddings": 16384,
    "rms_norm_eps": 1e-6,
    "num_nextn_predict_layers": 0,
    "tie_word_embeddings": False,
}

# DeepSeek-V4-Flash's first layers (hidden 4096; 64 query heads x 512 over one KV head, rope
# 64; q_lora 1024; output in 8 groups through o_lora 1024; window 128; CSA entries of 4 with a
# 64 x 128 indexer keeping 512, HCA entries of 128; 256 experts of 2048, 6 a token, 1 shared;
# 4 hyper-connection streams): layers 0-1 window-only, 2 CSA, 3 HCA, 0-2 hash-routed. A
# layer is 12.3 GiB in bf16 (12 of them its experts), and the first forward stacks one
# layer's experts beside them (common/model/dsv4.py V4MoE): 4 layers (50 GiB, 62 at that
# peak) fit one 80 GB GPU with room for the cache; 5 (74 GiB at the peak) would not.
DEEPSEEK_V4_FLASH: dict[str, Any] = {
    "architectures": ["DeepseekV4ForCausalLM"],
    "model_type": "deepseek_v4",
    "hidden_size": 4096,
    "moe_intermediate_size": 2048,
    "num_hidden_layers": 4,
    "num_attention_heads": 64,
    "num_key_value_heads": 1,
    "head_dim": 512,
    "partial_rotary_factor": 64 / 512,
    "q_lora_rank": 1024,
    "o_groups": 8,
    "o_lora_rank": 1024,
    "sliding_window": 128,
    "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128},
    "index_n_heads": 64,
    "index_head_dim": 128,
    "index_topk": 512,
    "n_routed_experts": 256,
    "num_experts_per_tok": 6,
    "n_shared_experts": 1,
    "hc_mult": 4,
    "max_position_embeddings": 16384,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
}

CONFIG_SHAPES: dict[str, dict[str, Any]] = {
    "30b-a3b-full": QWEN3_30B_A3B_FULL,
    "v2-lite": DEEPSEEK_V2_LITE,
    "dsv32": DEEPSEEK_V32,
    "dsv4-flash": DEEPSEEK_V4_FLASH,
}


def v4_flash_layers(num_layers: int) -> dict[str, list[str]]:
    """V4-Flash's layer kinds for ``num_layers`` layers: its own from 4 layers on (0-1
    window-only, then CSA and HCA alternating; 0-2 hash-routed); fewer keep one of each
    attention kind (window, CSA, HCA) and a hash-routed first layer."""
    sw, csa, hca = (
        "sliding_attention",
        "compressed_sparse_attention",
        "heavily_compressed_attention",
    )
    if num_layers >= 4:
        kinds = [sw, sw] + [csa if i % 2 == 0 else hca for i in range(num_layers - 2)]
        mlp = ["hash_moe" if i < 3 else "moe" for i in range(num_layers)]
    else:
        kinds = [sw, csa, hca][:num_layers]
        mlp = ["hash_moe"] + [
            "hash_moe" if i < num_layers - 1 else "moe" for i in range(1, num_layers)
        ]
    return {"layer_types": kinds, "mlp_layer_types": mlp}


def shape_config(shape: str, num_layers: int | None = None) -> dict[str, Any]:
    """config.json of a ``CONFIG_SHAPES`` shape (vocabulary and special tokens added at
    write), with ``num_layers`` layers if given."""
    raw = dict(CONFIG_SHAPES[shape])
    if num_layers is not None:
        raw["num_hidden_layers"] = num_layers
    if raw["model_type"] == "deepseek_v4":
        raw.update(v4_flash_layers(raw["num_hidden_layers"]))
    return raw


def _meta_model(raw: dict[str, Any]) -> Any:
    """The pdserve model of config ``raw`` on the meta device (one rank)."""
    from pdserve.common.model.config import ModelConfig
    from pdserve.common.model.meta import meta_modules
    from pdserve.common.model.registry import family_named
    from pdserve.common.parallel.context import ParallelContext

    cfg = ModelConfig.from_dict(raw)
    with meta_modules():
        return family_named(cfg.architecture).load().build_model(cfg, ParallelContext())


def _is_routed_expert(name: str) -> bool:
    return ".experts." in name and ".shared_experts." not in name


def shape_bytes(raw: dict[str, Any], dtype_size: int = 2) -> tuple[int, int]:
    """(bytes of every weight, bytes of the largest layer's routed experts) of config
    ``raw`` in a ``dtype_size``-byte float dtype."""
    total, experts = 0, dict[str, int]()
    for name, t in _meta_model(raw).state_dict().items():
        size = t.numel() * (dtype_size if t.is_floating_point() else t.element_size())
        total += size
        if _is_routed_expert(name):
            layer = name.split(".")[2]
            experts[layer] = experts.get(layer, 0) + size
    return total, max(experts.values(), default=0)


_ST_DTYPES = {
    "bfloat16": "BF16",
    "float16": "F16",
    "float32": "F32",
    "int64": "I64",
    "int32": "I32",
}


def _write_sparse_safetensors(
    file: Path, tensors: list[tuple[str, tuple[int, ...], str]], fill: Callable[[str], Any]
) -> None:
    """A safetensors file of ``tensors`` (name, shape, dtype name), each one's values from
    ``fill(name)`` (a CPU tensor) written as it comes, or left a hole (zeros) where it gives
    None: one tensor in memory at a time."""
    import struct

    import torch

    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    spans = []
    for name, shape, dtype in tensors:
        size = getattr(torch, dtype).itemsize
        for d in shape:
            size *= d
        header[name] = {
            "dtype": _ST_DTYPES[dtype],
            "shape": list(shape),
            "data_offsets": [offset, offset + size],
        }
        spans.append((name, offset, size))
        offset += size
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    with open(file, "wb") as f:
        f.write(struct.pack("<Q", len(head)) + head)
        base = f.tell()
        for name, start, size in spans:
            values = fill(name)
            if values is None:
                continue
            data = values.contiguous().view(torch.uint8).reshape(-1).numpy().tobytes()
            assert len(data) == size, name
            f.seek(base + start)
            f.write(data)
        f.truncate(base + offset)


def write_random_shape(
    path: str | os.PathLike[str],
    config: dict[str, Any],
    *,
    dtype: str = "bfloat16",
    device: str = "cpu",
    seed: int = 0,
    tokenizer_from: str | os.PathLike[str] | None = None,
    zero_experts: bool = True,
) -> Path:
    """A random checkpoint of ``config`` (a config.json without vocabulary and special
    tokens: those of the tokenizer's) with the tensors its pdserve model holds: matrices
    N(0, 0.02) drawn on ``device``, norms and scales at one, biases and sinks at zero,
    hash-routing tables random experts; the routed experts zeros (holes) when
    ``zero_experts``. One safetensors file per layer plus one for the rest, and the index
    transformers reads."""
    import re

    import torch

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    source = resolve_model(tokenizer_from)
    raw = {
        **config,
        "vocab_size": tokenizer_vocab_size(source),
        "torch_dtype": dtype,
        **special_token_ids(source),
    }
    model = _meta_model(raw)
    torch_dtype = getattr(torch, dtype)
    weight, ones = _draws(torch_dtype, device, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    num_experts = raw.get("n_routed_experts") or raw.get("num_experts") or 1

    def fill(name: str) -> Any:
        t = state[name]
        if not t.is_floating_point():  # hash routing: token id -> experts
            return torch.randint(0, num_experts, tuple(t.shape), generator=gen, dtype=t.dtype)
        if t.dim() >= 2:
            return None if zero_experts and _is_routed_expert(name) else weight(*t.shape)
        if "norm" in name or name.endswith("scale"):
            return ones(t.shape[0])
        return None  # biases, sinks, bases: zeros

    state = model.state_dict()
    layer_of = re.compile(r"^model\.layers\.(\d+)\.")
    shards: dict[int, list[tuple[str, tuple[int, ...], str]]] = {}
    for name, t in state.items():
        m = layer_of.match(name)
        dt = dtype if t.is_floating_point() else str(t.dtype).removeprefix("torch.")
        shards.setdefault(-1 if m is None else int(m[1]), []).append((name, tuple(t.shape), dt))
    count = len(shards)
    weight_map = {}
    for i, key in enumerate(sorted(shards)):
        file = f"model-{i + 1:05d}-of-{count:05d}.safetensors"
        _write_sparse_safetensors(out / file, shards[key], fill)
        weight_map.update({name: file for name, _, _ in shards[key]})
    total = sum(
        int(t.numel()) * (torch_dtype.itemsize if t.is_floating_point() else t.element_size())
        for t in state.values()
    )
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    (out / "config.json").write_text(json.dumps(raw, indent=1))
    copy_tokenizer(source, out)
    return out
