"""DeepSeek-V4's switches (``DeepseekV4Config``) that no other family has, read once by
common/model/families/deepseek_v4.py into ``ModelConfig.v4``; torch-free (the router reads
configs).

The cache row of a token and layer (common/model/deepseek/dsv4_attention.py) holds what a later step
needs to rebuild that layer's attention state from the paged cache alone: the shared K=V
row (``head_dim``), and for a compressed layer the compressor's per-token projections (kv
and gate: ``head_dim`` each for HCA, two series of ``head_dim`` each for CSA) plus, CSA
only, the indexer compressor's (two series of ``index_head_dim``). Every layer's row has
the width of the widest (``row_width``).
"""

from __future__ import annotations

import msgspec

SLIDING = "sliding_attention"
CSA = "compressed_sparse_attention"
HCA = "heavily_compressed_attention"
LAYER_KINDS = (SLIDING, CSA, HCA)
HASH_MOE = "hash_moe"
MOE = "moe"


class V4Config(msgspec.Struct, frozen=True, kw_only=True):
    layer_kinds: tuple[str, ...]  # per layer: SLIDING, CSA or HCA
    mlp_kinds: tuple[str, ...]  # per layer: HASH_MOE or MOE
    compress_rates: dict[str, int]  # CSA, HCA -> tokens per compressed entry
    rope_dim: int  # the trailing rotated values of each head
    compress_rope_theta: float
    compress_rope_scaling: dict[str, object] | None  # transformers' "compress" rope params
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    swiglu_limit: float
    num_experts: int
    top_k: int
    moe_intermediate_size: int
    num_shared_experts: int
    routed_scaling_factor: float
    scoring: str  # transformers' scoring_func: sqrtsoftplus, softmax or sigmoid
    index_n_heads: int
    index_head_dim: int
    index_topk: int

    def rate(self, layer: int) -> int:
        """Tokens per compressed entry of ``layer`` (0: a sliding layer)."""
        return self.compress_rates.get(self.layer_kinds[layer], 0)

    def cache_kinds(self, window: int) -> list[tuple[tuple[int, ...], int | None, int]]:
        """(layers, sliding window, tokens per slot) of each kind of KV cache group
        (common/engine/kv_groups.py): every layer's per-token rows over a window that also
        holds what the compressors still pool (an open window of m tokens, and CSA's
        previous one: 2m), then the compressed entries of each kind's layers."""
        kinds = self.layer_kinds
        span = max([window] + [2 * self.rate(i) if k == CSA else self.rate(i)
                               for i, k in enumerate(kinds)])  # fmt: skip
        out: list[tuple[tuple[int, ...], int | None, int]] = [(tuple(range(len(kinds))), span, 1)]
        for kind in (CSA, HCA):
            layers = tuple(i for i, k in enumerate(kinds) if k == kind)
            if layers:
                out.append((layers, None, self.compress_rates[kind]))
        return out

    def row_width(self, head_dim: int) -> int:
        """Values of one token's cache row in every layer (the widest layer's)."""
        width = head_dim
        if HCA in self.layer_kinds:
            width = max(width, 3 * head_dim)
        if CSA in self.layer_kinds:
            width = max(width, 5 * head_dim + 4 * self.index_head_dim)
        return width
