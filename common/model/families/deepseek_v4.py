"""DeepSeek-V4 (``DeepseekV4ForCausalLM``): shared-KV multi-query attention (one K=V head of
``head_dim``, partial interleaved rope on its last ``qk_rope_head_dim`` values, per-head
sinks, a grouped low-rank output projection) over a sliding window plus compressed entries
(``compressed_sparse_attention``: entries of 4 tokens, two overlapping series, a lightning
indexer's top-k; ``heavily_compressed_attention``: entries of 128 tokens; or
``sliding_attention``: the window only), residual streams mixed by hyper-connections, and
mixtures of experts routed by a token-id table (``hash_moe``) or by sqrtsoftplus top-k.
The layers: common/model/deepseek/dsv4.py and common/model/deepseek/dsv4_attention.py.

As transformers' ``DeepseekV4Config`` reads config.json (its legacy keys ``compress_ratios``,
``num_hash_layers``, ``qk_rope_head_dim`` folded in as it folds them). What runs: CPU at
any TP that splits its heads, output groups and experts (common/model/deepseek/dsv4_tp.py),
monolithic, chunked, preempted, prefix-cached, disaggregated and with a PCP prefill: a
window of per-token rows and the compressed entries are KV cache groups
(common/engine/kv_groups.py cache_groups), which pulls and PCP replicas carry like any
other. Refused by name: CUDA (common/engine/model_loader.py), a TP that does not split it
(here), an fp8 KV cache of shapes vLLM's fp8 form does not tile (common/engine/
latent_format.py; kernels/fp8_ds_v4.py), a softmax or sigmoid router, a main rope other
than the default one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pdserve.common.errors import ModelLoadError
from pdserve.common.model.checkpoint.config import SLIDING_ATTENTION, ModelConfig, eos_token_ids
from pdserve.common.model.deepseek.dsv4_config import CSA, HASH_MOE, HCA, LAYER_KINDS, MOE, V4Config

if TYPE_CHECKING:
    import torch

    from pdserve.common.model.decoder import CausalLM
    from pdserve.common.model.family_api import CacheKind
    from pdserve.common.parallel.context import ParallelContext

RATE_KINDS = {0: SLIDING_ATTENTION, 4: CSA, 128: HCA}
# --speculative-config dspark reads the checkpoint's own DSpark module (mtp.*)
OWN_DSPARK = True


def _layer_kinds(raw: dict[str, Any], n: int) -> tuple[str, ...]:
    kinds = raw.get("layer_types")
    if kinds is None and raw.get("compress_ratios") is not None:
        kinds = [RATE_KINDS[r] for r in raw["compress_ratios"]]
    if kinds is None:  # transformers' default: 2 HCA, then CSA / HCA interleaved
        kinds = [HCA] * min(n, 2) + [CSA if i % 2 else HCA for i in range(max(n - 2, 0))]
    bad = sorted(set(kinds) - set(LAYER_KINDS))
    if len(kinds) < n or bad:
        raise ModelLoadError(f"deepseek_v4: layer_types {kinds} (one of {LAYER_KINDS} a layer)")
    return tuple(kinds[:n])


def _mlp_kinds(raw: dict[str, Any], n: int) -> tuple[str, ...]:
    kinds = raw.get("mlp_layer_types")
    if kinds is None:
        num_hash = raw.get("num_hash_layers", 3)
        kinds = [HASH_MOE] * min(n, num_hash) + [MOE] * max(0, n - num_hash)
    if len(kinds) < n or set(kinds) - {HASH_MOE, MOE}:
        raise ModelLoadError(f"deepseek_v4: mlp_layer_types {kinds} (hash_moe or moe a layer)")
    return tuple(kinds[:n])


def read_config(raw: dict[str, Any]) -> ModelConfig:
    n = raw["num_hidden_layers"]
    head_dim = raw.get("head_dim", 512)
    factor = raw.get("partial_rotary_factor")
    if factor is None:
        factor = raw["qk_rope_head_dim"] / head_dim if "qk_rope_head_dim" in raw else 64 / 512
    rope_dim = int(head_dim * factor)
    rates = {CSA: 4, HCA: 128, **(raw.get("compress_rates") or {})}
    rope = raw.get("rope_parameters") or {}
    main = rope.get("main") if isinstance(rope.get("main"), dict) else None
    compress = rope.get("compress") if isinstance(rope.get("compress"), dict) else None
    if main is not None and main.get("rope_type", "default") != "default":
        raise ModelLoadError(f"deepseek_v4: main rope {main['rope_type']!r} (default only)")
    scaling = None
    if compress is not None and compress.get("rope_type", "default") != "default":
        scaling = {k: v for k, v in compress.items() if k != "rope_theta"}
    scoring = raw.get("scoring_func", "sqrtsoftplus")
    if scoring != "sqrtsoftplus":
        raise ModelLoadError(f"deepseek_v4: scoring_func {scoring!r} (sqrtsoftplus only)")
    v4 = V4Config(
        layer_kinds=_layer_kinds(raw, n),
        mlp_kinds=_mlp_kinds(raw, n),
        compress_rates={CSA: int(rates[CSA]), HCA: int(rates[HCA])},
        rope_dim=rope_dim,
        compress_rope_theta=float(
            (compress or {}).get("rope_theta", raw.get("compress_rope_theta", 160000.0))
        ),
        compress_rope_scaling=scaling,
        q_lora_rank=raw.get("q_lora_rank", 1024),
        o_groups=raw.get("o_groups", 8),
        o_lora_rank=raw.get("o_lora_rank", 1024),
        hc_mult=raw.get("hc_mult", 4),
        hc_sinkhorn_iters=raw.get("hc_sinkhorn_iters", 20),
        hc_eps=raw.get("hc_eps", 1e-6),
        swiglu_limit=raw.get("swiglu_limit", 10.0),
        num_experts=raw.get("n_routed_experts", 256),
        top_k=raw.get("num_experts_per_tok", 6),
        moe_intermediate_size=raw.get("moe_intermediate_size", 2048),
        num_shared_experts=raw.get("n_shared_experts", 1),
        routed_scaling_factor=raw.get("routed_scaling_factor", 1.5),
        scoring=scoring,
        index_n_heads=raw.get("index_n_heads", 64),
        index_head_dim=raw.get("index_head_dim", 128),
        index_topk=raw.get("index_topk", 512),
    )
    return ModelConfig(
        model_type=raw["model_type"],
        vocab_size=raw["vocab_size"],
        hidden_size=raw["hidden_size"],
        intermediate_size=v4.moe_intermediate_size,
        num_hidden_layers=n,
        num_attention_heads=raw.get("num_attention_heads", 64),
        num_key_value_heads=1,  # one K=V row per token and layer
        head_dim=head_dim,
        max_position_embeddings=raw.get("max_position_embeddings", 1048576),
        rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
        rope_theta=float((main or {}).get("rope_theta", raw.get("rope_theta", 10000.0))),
        sliding_window=raw.get("sliding_window", 128),
        tie_word_embeddings=raw.get("tie_word_embeddings", False),
        # every layer's per-token rows slide over a window (KV cache groups of their own:
        # common/engine/kv_groups.py cache_groups), its entries are kept whole
        layer_types=("sliding_attention",) * n,
        bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=eos_token_ids(raw),
        v4=v4,
    )


def build_model(cfg: ModelConfig, parallel: ParallelContext | None) -> CausalLM:
    # torch only here: reading a config (the router does) imports none
    from pdserve.common.model.deepseek.dsv4 import DeepseekV4Model
    from pdserve.common.model.deepseek.dsv4_tp import check_v4_tp
    from pdserve.common.parallel.context import ParallelContext

    par = parallel or ParallelContext()
    reason = check_v4_tp(cfg, par.tp_size)
    if reason:
        raise ModelLoadError(f"deepseek_v4: {reason}")
    return DeepseekV4Model(cfg, cfg.sliding_window or 128, par)  # type: ignore[return-value]


def cache_kinds(cfg: ModelConfig) -> list[CacheKind]:
    """Every layer's per-token rows over a window, then the compressed entries of the CSA
    and HCA layers (common/model/deepseek/dsv4_config.py ``cache_kinds``)."""
    assert cfg.v4 is not None
    return cfg.v4.cache_kinds(cfg.sliding_window or 128)


def row_kind(cfg: ModelConfig) -> str:
    return "v4"  # one row a token and layer (common/model/deepseek/dsv4_config.py row_width)


def shard_state(
    state: dict[str, torch.Tensor], cfg: ModelConfig, tp_size: int, tp_rank: int
) -> dict[str, torch.Tensor]:
    """Its own TP cut: a rank's heads, sinks, output groups, experts, shared-expert slice
    (common/model/deepseek/dsv4_tp.py)."""
    from pdserve.common.model.deepseek.dsv4_tp import shard_v4_state

    return shard_v4_state(state, cfg, tp_size, tp_rank)
