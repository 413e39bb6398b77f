"""Write a float32 GGUF of a Hugging Face checkpoint, as llama.cpp's converter would for the
qwen2/qwen3 architectures (no q/k permutation: that is llama's only), with the tokenizer
fields of the embedded model's GGUF. Tests use it to make GGUF files without a network."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

from safetensors.torch import load_file


@functools.cache
def _tokenizer_fields(path: Path) -> list[tuple[str, Any, Any, Any]]:
    """The tokenizer.* fields of a GGUF file: (key, value, type, array element type).
    Read once a session (parsing the embedded model's 49k-token arrays takes seconds)."""
    import gguf

    out = []
    for key, field in gguf.GGUFReader(str(path)).fields.items():
        if key.startswith("tokenizer."):
            vtype = field.types[0]
            sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
            out.append((key, field.contents(), vtype, sub))
    return out


def write_gguf(model_dir: Path, out: Path, tokenizer_gguf: Path) -> Path:
    import gguf

    cfg = json.loads((model_dir / "config.json").read_text())
    arch = cfg["model_type"]
    if arch not in ("qwen2", "qwen3"):
        raise ValueError(f"only qwen2/qwen3 are written without llama's q/k permutation: {arch}")
    num_layers = cfg["num_hidden_layers"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    rope = cfg.get("rope_parameters") or {}
    writer = gguf.GGUFWriter(str(out), arch)
    writer.add_block_count(num_layers)
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(cfg["num_attention_heads"])
    writer.add_head_count_kv(cfg["num_key_value_heads"])
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_freq_base(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_vocab_size(cfg["vocab_size"])
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    for key, value, vtype, sub in _tokenizer_fields(tokenizer_gguf):
        writer.add_key_value(key, value, vtype, sub)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], num_layers)
    for name, tensor in load_file(model_dir / "model.safetensors").items():
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        if gguf_name is None:
            raise ValueError(f"no GGUF name for {name}")
        writer.add_tensor(gguf_name, tensor.float().numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out
