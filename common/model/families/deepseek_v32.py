"""DeepSeek-V3.2 (``DeepseekV32ForCausalLM``): DeepSeek-V3 (common/model/families/deepseek.py:
MLA, sigmoid-routed experts with shared ones) whose attention is DeepSeek sparse attention
(common/model/deepseek/dsa.py): a lightning indexer per layer selects the ``index_topk`` cached
tokens each query attends.

As transformers' ``DeepseekV32Config`` reads config.json: V3's fields, with q always
low-rank (transformers dropped the single ``q_proj``: a config without ``q_lora_rank`` is
refused), rope always interleaved, the MLP of layer i sparse when ``mlp_layer_types[i]`` is
``"sparse"`` (by default from ``first_k_dense_replace`` on, 3), and the indexer's
``index_topk`` (2048), ``index_n_heads`` (64), ``index_head_dim`` (128). The cache row of a
token is V3's latent with the indexer's key after it (common/engine/latent_format.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import msgspec

from pdserve.common.errors import ModelLoadError
from pdserve.common.model.checkpoint.config import ModelConfig
from pdserve.common.model.families import deepseek
from pdserve.common.model.family_api import mla_unsupported

if TYPE_CHECKING:
    from pdserve.common.model.decoder import CausalLM
    from pdserve.common.parallel.context import ParallelContext


def read_config(raw: dict[str, Any]) -> ModelConfig:
    model_type = raw["model_type"]
    if raw.get("q_lora_rank", 1536) is None:
        raise ModelLoadError(
            f"{model_type}: q_lora_rank is null; DeepSeek-V3.2's indexer reads the low-rank "
            "query (q_a_proj), as transformers' DeepseekV32Attention does"
        )
    layers = raw["num_hidden_layers"]
    mlp_types = raw.get("mlp_layer_types")
    if mlp_types is not None:  # transformers 5 writes it; V3's reader takes the first dense
        sparse = [i for i, kind in enumerate(mlp_types) if kind == "sparse"]
        if sparse != list(range(layers - len(sparse), layers)):
            raise ModelLoadError(
                f"{model_type}: mlp_layer_types {mlp_types} puts dense layers after sparse "
                "ones; pdserve reads DeepSeek's dense-first layout (first_k_dense_replace)"
            )
        raw = {**raw, "first_k_dense_replace": layers - len(sparse)}
    cfg = deepseek.read_config({**raw, "model_type": "deepseek_v3", "rope_interleave": True})
    index_heads = raw.get("index_n_heads", 64)
    index_dim = raw.get("index_head_dim", 128)
    if index_dim <= cfg.qk_rope_head_dim:
        raise ModelLoadError(
            f"{model_type}: index_head_dim {index_dim} must exceed qk_rope_head_dim "
            f"{cfg.qk_rope_head_dim} (the indexer rotates its first qk_rope_head_dim values)"
        )
    return msgspec.structs.replace(
        cfg,
        model_type=model_type,
        index_topk=raw.get("index_topk", 2048),
        index_n_heads=index_heads,
        index_head_dim=index_dim,
    )


def build_model(cfg: ModelConfig, parallel: ParallelContext | None) -> CausalLM:
    # torch only here: reading a config (the router does) imports none
    from pdserve.common.model.decoder import CausalLM
    from pdserve.common.model.deepseek.dsa import IndexedMLAAttention
    from pdserve.common.model.layers.mlp import sparse_or_dense_mlp

    return CausalLM(cfg, parallel, IndexedMLAAttention, sparse_or_dense_mlp)


def unsupported_ops(cfg: ModelConfig, device_type: str) -> dict[str, str]:
    """MLA's, and on CUDA the lightning indexer kernel's (kernels/triton_indexer.py): its
    head a power of two >= 16."""
    out = mla_unsupported(cfg, device_type)
    dim = cfg.index_head_dim
    if device_type == "cuda" and (dim < 16 or dim & (dim - 1)):
        out["indexer_topk"] = (
            "the CUDA lightning indexer kernel (kernels/triton_indexer.py) needs "
            f"index_head_dim to be a power of two >= 16; this model has {dim}"
        )
    return out
