"""Grouped-query attention (the Llama-shaped families) on a paged KV cache.

Parameter names are transformers' ``LlamaAttention``'s (``q_proj``, ``k_proj``, ``v_proj``,
``o_proj``; Qwen3's ``q_norm``/``k_norm``), so a checkpoint loads by name. What differs
between the families (biases, the per-head q/k norm, a layer's sliding window) is read from
``ModelConfig``, which each family's module (common/model/families/) fills in.

Tensor parallel: each rank holds its query heads and KV heads (common/parallel/tp.py);
q/k/v are column-parallel, o_proj row-parallel followed by an all-reduce over the TP group.
On CUDA, :meth:`GQAAttention.pack` puts q/k/v into one matrix (one GEMM instead of three);
the parameters stay, as views into it, so the state dict keeps HF's names.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from pdserve import kernels
from pdserve.common.model.checkpoint.config import ModelConfig
from pdserve.common.model.layers.attention import AttentionMetadata, paged_attention
from pdserve.common.model.layers.linear import Linear, pack_linears
from pdserve.common.model.layers.norm import RMSNorm
from pdserve.common.parallel.context import ParallelContext
from pdserve.common.parallel.tp import kv_heads_of, q_heads_of


class GQAAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, par: ParallelContext, layer: int) -> None:
        super().__init__()
        self.par = par
        self.num_heads = q_heads_of(cfg.num_attention_heads, par.tp_size, par.tp_rank)[1]
        self.num_kv_heads = kv_heads_of(cfg.num_key_value_heads, par.tp_size, par.tp_rank)[1]
        self.head_dim = cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        self.sliding_window = cfg.window_of(layer)
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(cfg.hidden_size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(
            self.num_heads * self.head_dim, cfg.hidden_size, bias=cfg.o_proj_bias
        )
        # Qwen3: [head_dim] weights, the same on every TP rank
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        # packed (pack): q/k/v as one GEMM, o_proj's (without its bias under TP)
        self.qkv: Linear | None = None
        self.o: Linear | None = None

    def pack(self, prepack: bool = False) -> None:
        self.qkv = Linear(*pack_linears([self.q_proj, self.k_proj, self.v_proj]), prepack)
        o_bias = self.o_proj.bias if self.par.tp_size == 1 else None
        self.o = Linear(self.o_proj.weight, o_bias, prepack)

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]
        rope: tuple[torch.Tensor, torch.Tensor],  # cos, sin [T, D] in x's dtype
        layer_cache: torch.Tensor,  # [N, 2, H_kv, B, D]
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        num_tokens = x.shape[0]
        d = self.head_dim
        if self.qkv is not None:
            q, k, v = self.qkv(x).split(
                [self.num_heads * d, self.num_kv_heads * d, self.num_kv_heads * d], dim=-1
            )
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if self.q_norm is not None and self.k_norm is not None:  # per head: rows of [T * H, D]
            q = self.q_norm(q.reshape(-1, d))
            k = self.k_norm(k.reshape(-1, d))
        q = q.view(num_tokens, self.num_heads, d)
        k = k.view(num_tokens, self.num_kv_heads, d)
        v = v.view(num_tokens, self.num_kv_heads, d)
        q, k = kernels.rotary(q, k, *rope)
        out = paged_attention(q, k, v, layer_cache, meta, self.scale, self.sliding_window)
        out = out.reshape(num_tokens, self.num_heads * self.head_dim)
        if self.par.tp_size == 1:
            return self.o(out) if self.o is not None else self.o_proj(out)
        # row-parallel: partial sums reduced, the bias added once after
        out = self.o(out) if self.o is not None else F.linear(out, self.o_proj.weight)
        out = self.par.all_reduce_tp(out)
        return out if self.o_proj.bias is None else out + self.o_proj.bias


def attention_shards(
    cfg: ModelConfig, tp_size: int, tp_rank: int
) -> tuple[dict[str, tuple[int, int]], dict[str, tuple[int, int]]]:
    """(rows, cols): the (start, size) slices of TP rank ``tp_rank`` of the projections
    split by heads, rows of q/k/v (column-parallel), columns of o_proj."""
    d = cfg.head_dim
    q0, nq = q_heads_of(cfg.num_attention_heads, tp_size, tp_rank)
    k0, nk = kv_heads_of(cfg.num_key_value_heads, tp_size, tp_rank)
    rows = {"q_proj": (q0 * d, nq * d), "k_proj": (k0 * d, nk * d), "v_proj": (k0 * d, nk * d)}
    cols = {"o_proj": (q0 * d, nq * d)}
    return rows, cols
