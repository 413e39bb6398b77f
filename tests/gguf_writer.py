"""Write a GGUF of a Hugging Face checkpoint as llama.cpp's converter would (llama: q/k
rows permuted as it does; qwen2/qwen3: as they are), float32 or quantized as the embedded
model is (Q4_1 matrices, a Q8_0 embedding, float32 norms), with the checkpoint's tokenizer
cut to its vocabulary. Tests use it to make GGUF files without a network."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from safetensors.torch import load_file


def _tokenizer(model_dir: Path, vocab_size: int) -> dict[str, Any]:
    """The checkpoint's byte-level BPE tokenizer (tokenizer.json) as llama.cpp's converter
    writes a gpt2-type vocabulary, cut to the model's ``vocab_size`` first ids: the tokens
    below it, and the merges whose two parts and result are among them."""
    tok = json.loads((model_dir / "tokenizer.json").read_text())
    if tok["model"]["type"] != "BPE":
        raise ValueError(f"only a BPE tokenizer is written: {tok['model']['type']}")
    ids = {t: i for t, i in tok["model"]["vocab"].items() if i < vocab_size}
    special = {a["content"] for a in tok["added_tokens"] if a["special"]}
    ids.update({a["content"]: a["id"] for a in tok["added_tokens"] if a["id"] < vocab_size})
    tokens = sorted(ids, key=ids.__getitem__)
    if [ids[t] for t in tokens] != list(range(vocab_size)):
        raise ValueError(f"the tokenizer has no token for some ids below {vocab_size}")
    merges = [
        " ".join(pair)
        for pair in (m if isinstance(m, list) else m.split(" ") for m in tok["model"]["merges"])
        if pair[0] in ids and pair[1] in ids and "".join(pair) in ids
    ]
    config = json.loads((model_dir / "config.json").read_text())
    template = json.loads((model_dir / "tokenizer_config.json").read_text()).get("chat_template")
    return {
        "tokens": tokens,
        "types": [3 if t in special else 1 for t in tokens],  # CONTROL, NORMAL
        "merges": merges,
        "bos": config.get("bos_token_id"),
        "eos": config.get("eos_token_id"),
        "pad": config.get("pad_token_id"),
        "chat_template": template,
    }


def _permute(weight: Any, num_heads: int) -> Any:
    """llama.cpp's q/k row order for a llama checkpoint (the two rotary halves of each
    head interleaved); transformers' GGUF reader undoes it."""
    rows = weight.shape[0]
    return (
        weight.reshape(num_heads, 2, rows // num_heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def _tensor_type(gguf: Any, hf_name: str, weight: Any, quantize: bool) -> Any:
    """The embedded model's choice: Q8_0 embedding, Q4_1 matrices, float32 norms."""
    if not quantize or weight.ndim != 2 or weight.shape[-1] % 32:
        return gguf.GGMLQuantizationType.F32
    if hf_name == "model.embed_tokens.weight":
        return gguf.GGMLQuantizationType.Q8_0
    return gguf.GGMLQuantizationType.Q4_1


def write_gguf(model_dir: Path, out: Path, quantize: bool = False) -> Path:
    import gguf
    from gguf import quants

    cfg = json.loads((model_dir / "config.json").read_text())
    arch = cfg["model_type"]
    if arch not in ("llama", "qwen2", "qwen3"):
        raise ValueError(f"only llama, qwen2 and qwen3 checkpoints are written: {arch}")
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
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_1 if quantize else gguf.LlamaFileType.ALL_F32)
    tok = _tokenizer(model_dir, cfg["vocab_size"])
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")  # test checkpoints carry the embedded model's tokenizer
    writer.add_token_list(tok["tokens"])
    writer.add_token_types(tok["types"])
    writer.add_token_merges(tok["merges"])
    writer.add_add_bos_token(False)
    writer.add_add_space_prefix(False)
    for name in ("bos", "eos", "pad"):
        if tok[name] is not None:
            getattr(writer, f"add_{name}_token_id")(tok[name])
    if tok["chat_template"]:
        writer.add_chat_template(tok["chat_template"])
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], num_layers)
    for name, tensor in load_file(model_dir / "model.safetensors").items():
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        if gguf_name is None:
            raise ValueError(f"no GGUF name for {name}")
        weight = tensor.float().numpy()
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = cfg["num_attention_heads" if "q_proj" in name else "num_key_value_heads"]
            weight = _permute(weight, heads)
        qtype = _tensor_type(gguf, name, weight, quantize)
        if qtype == gguf.GGMLQuantizationType.F32:
            writer.add_tensor(gguf_name, weight)
        else:
            writer.add_tensor(gguf_name, quants.quantize(weight, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out
