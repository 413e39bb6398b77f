"""A random DeepSeek-V3 MTP layer added to a random dense DeepSeek checkpoint (benchmarks:
``pdserve bench engine --shape dsv3 --speculative-config '{"method": "mtp", ...}'``).

The layer goes into its own file, ``mtp.safetensors`` beside the model's (the loaders read
every ``*.safetensors``): layer ``num_hidden_layers`` with MLA attention and a dense MLP of
the model's sizes, ``enorm``, ``hnorm``, ``eh_proj`` and ``shared_head.norm``; no
``embed_tokens`` or ``shared_head.head`` (the target's serve, as in DeepSeek-V3's release).
Its drafts are random: a benchmark of it measures the mechanism's cost, not acceptance.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pdserve.common.model.random_shapes import _dense_mlp, _draws, _layer_norms

MTP_FILE = "mtp.safetensors"


def add_random_mtp_layer(model_dir: Path, device: str = "cpu", seed: int = 1) -> Path:
    """Write ``mtp.safetensors`` into ``model_dir`` unless it is there; returns its path."""
    import torch
    from safetensors.torch import save_file

    out = model_dir / MTP_FILE
    if out.is_file():
        return out
    cfg: dict[str, Any] = json.loads((model_dir / "config.json").read_text())
    if cfg.get("model_type") != "deepseek_v3" or cfg.get("num_nextn_predict_layers", 1) < 1:
        raise ValueError(f"{model_dir}: not a DeepSeek-V3 checkpoint declaring an MTP layer")
    weight, ones = _draws(getattr(torch, cfg.get("torch_dtype", "bfloat16")), device, seed)
    hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    q_lora, kv_lora = cfg["q_lora_rank"], cfg["kv_lora_rank"]
    rope, nope, v = cfg["qk_rope_head_dim"], cfg["qk_nope_head_dim"], cfg["v_head_dim"]
    p = f"model.layers.{cfg['num_hidden_layers']}."
    state = {
        p + "self_attn.q_a_proj.weight": weight(q_lora, hidden),
        p + "self_attn.q_a_layernorm.weight": ones(q_lora),
        p + "self_attn.q_b_proj.weight": weight(heads * (nope + rope), q_lora),
        p + "self_attn.kv_a_proj_with_mqa.weight": weight(kv_lora + rope, hidden),
        p + "self_attn.kv_a_layernorm.weight": ones(kv_lora),
        p + "self_attn.kv_b_proj.weight": weight(heads * (nope + v), kv_lora),
        p + "self_attn.o_proj.weight": weight(hidden, heads * v),
        p + "enorm.weight": ones(hidden),
        p + "hnorm.weight": ones(hidden),
        p + "eh_proj.weight": weight(hidden, 2 * hidden),
        p + "shared_head.norm.weight": ones(hidden),
        **_dense_mlp(p, weight, hidden, cfg["intermediate_size"]),
        **_layer_norms(p, ones, hidden),
    }
    tmp = out.with_name(out.name + ".tmp")
    save_file(state, str(tmp), metadata={"format": "pt"})
    tmp.replace(out)
    return out
