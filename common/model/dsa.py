"""DeepSeek sparse attention (DeepSeek-V3.2): MLA whose queries attend only the cached
tokens a lightning indexer selects.

Parameter names are transformers' ``DeepseekV32Attention``'s: the MLA projections of
common/model/mla.py (q always low-rank) plus ``indexer.wq_b`` (the indexer's queries from
the MLA's normed ``q_a`` output), ``indexer.wk`` and ``indexer.k_norm`` (a LayerNorm: its
one key per token), ``indexer.weights_proj`` (a weight per indexer head and token).

The indexer's score of key t for the query at position p is
``sum_h w[p, h] * relu(q[p, h] . k[t]) * index_head_dim^-0.5 * index_n_heads^-0.5`` over
its heads, in float32; the query attends the ``index_topk`` visible keys (t <= p) of the
highest scores, all of them while there are fewer. Its rope is the non-interleaved one over
the first ``qk_rope_head_dim`` values of each head (the MLA's is interleaved).

The cache row of a token is the MLA latent, its rope key, then the indexer's key
(common/engine/latent_format.py: ``index_dim``), written with every new token, gathered
from every PCP rank first like the latent; with ``--kv-cache-dtype fp8`` that row is stored
as its fp8_ds_mla record followed by the key's fp8 form (kernels/fp8_ds_mla.py
``quantize_indexed``), quantized on write and dequantized as the rows are read.
Attention runs here in torch, one sequence (or PCP piece) at a time: its context rows
gathered, the indexer's selection made a mask, the latent expanded into per-head K/V by
``kv_b_proj`` and SDPA under causal & selected, as transformers computes it. Decode takes the same path (a query of one token). It is the
reference: no Triton kernel of the indexer or of sparse MLA exists yet, and CUDA refuses the
model (common/engine/model_loader.py).

Tensor parallel: the MLA heads split as in common/model/mla.py; the indexer is replicated,
so every rank selects the same keys.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from pdserve import kernels
from pdserve.common.model.attention import AttentionMetadata
from pdserve.common.model.config import ModelConfig
from pdserve.common.model.mla import MLAAttention
from pdserve.common.model.mla_prefill import gather_rows
from pdserve.common.parallel.context import ParallelContext
from pdserve.kernels import fp8_ds_mla

INDEX_NORM_EPS = 1e-6  # transformers' k_norm: LayerNorm(index_head_dim, eps=1e-6)


class Indexer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        assert cfg.q_lora_rank is not None  # the family refuses a V3.2 without q_a_proj
        self.num_heads, self.head_dim = cfg.index_n_heads, cfg.index_head_dim
        self.rope = cfg.qk_rope_head_dim
        self.topk = cfg.index_topk
        self.wq_b = nn.Linear(cfg.q_lora_rank, self.num_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(cfg.hidden_size, self.head_dim, bias=False)
        self.k_norm = nn.LayerNorm(self.head_dim, eps=INDEX_NORM_EPS)
        self.weights_proj = nn.Linear(cfg.hidden_size, self.num_heads, bias=False)

    def project(
        self,
        x: torch.Tensor,  # [T, hidden]
        q_resid: torch.Tensor,  # [T, q_lora_rank]: q_a_layernorm(q_a_proj(x))
        rope: tuple[torch.Tensor, torch.Tensor],  # cos, sin [T, rope]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(queries [T, H_i, D_i], keys [T, D_i], head weights [T, H_i] float32)."""
        q = self.wq_b(q_resid).view(-1, self.num_heads, self.head_dim)
        k = self.k_norm(self.wk(x))[:, None, :]  # [T, 1, D_i]
        q_rot, k_rot = kernels.rotary(
            q[..., : self.rope].contiguous(), k[..., : self.rope].contiguous(), *rope
        )
        q = torch.cat((q_rot, q[..., self.rope :]), dim=-1)
        k = torch.cat((k_rot, k[..., self.rope :]), dim=-1)[:, 0]
        weights = F.linear(x.float(), self.weights_proj.weight.float()) * self.num_heads**-0.5
        return q, k, weights

    def select(
        self,
        q: torch.Tensor,  # [n, H_i, D_i]: the queries of one sequence, positions ctx - n ..
        weights: torch.Tensor,  # [n, H_i] float32
        keys: torch.Tensor,  # [ctx, D_i]: every cached key of the sequence
        visible: torch.Tensor,  # [n, ctx] bool: causal
    ) -> torch.Tensor:  # [n, ctx] bool: the keys each query attends
        # op for op transformers' (fp32 matmuls of [n, H, D] x [D, ctx], then the weighted
        # sum over heads as [n, 1, H] x [n, H, ctx]): near-equal scores order the same
        scores = torch.matmul(q.float(), keys.float().t()) * self.head_dim**-0.5  # [n, H, ctx]
        index = torch.matmul(weights[:, None, :], F.relu(scores))[:, 0]  # [n, ctx]
        index = index.masked_fill(~visible, float("-inf"))
        top = index.topk(min(self.topk, index.shape[-1]), dim=-1).indices
        chosen = torch.zeros_like(visible).scatter_(-1, top, True)
        return chosen & visible


class IndexedMLAAttention(MLAAttention):
    """MLA (its projections and TP split) with a lightning indexer choosing the keys."""

    def __init__(self, cfg: ModelConfig, par: ParallelContext, layer: int) -> None:
        super().__init__(cfg, par, layer)
        self.indexer = Indexer(cfg)

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]
        rope: tuple[torch.Tensor, torch.Tensor],  # cos, sin [T, rope]
        layer_cache: torch.Tensor,  # [N, 1, 1, B, latent + rope + index]
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [T, hidden]
        num_tokens = x.shape[0]
        assert self.q_a_proj and self.q_a_layernorm and self.q_b_proj
        q_resid = self.q_a_layernorm(self.q_a_proj(x))
        q = self.q_b_proj(q_resid).view(num_tokens, self.num_heads, self.nope + self.rope)
        q_nope, q_rope = q.split([self.nope, self.rope], dim=-1)
        latent, k_rope = self.kv_a_proj_with_mqa(x).split([self.latent, self.rope], dim=-1)
        latent = self.kv_a_layernorm(latent.contiguous())
        q_rope, k_rope = self._rotate(q_rope, k_rope[:, None, :], rope)
        index_q, index_k, weights = self.indexer.project(x, q_resid, rope)
        row = torch.cat((latent, k_rope[:, 0], index_k.to(latent.dtype)), dim=-1)
        if meta.kv_gather is not None:  # PCP: every rank writes every new token's row
            row = meta.kv_gather(row[None])[0]
        if fp8_ds_mla.is_ds_mla(layer_cache.dtype):  # each rank quantizes the same rows
            cuts = [self.latent, self.rope, self.indexer.head_dim]
            row = fp8_ds_mla.quantize_indexed(*row.split(cuts, dim=-1))
        write_rows(layer_cache, row, meta.slot_mapping)
        q = torch.cat((q_nope, q_rope), dim=-1)  # [T, H, nope + rope]
        out = torch.empty((num_tokens, self.num_heads, self.v_dim), dtype=x.dtype, device=x.device)
        for lo, hi, ctx, table in sequences(meta):
            rows = self._context_rows(layer_cache, table, ctx, q.dtype)
            positions = torch.arange(ctx - (hi - lo), ctx, device=x.device)
            visible = torch.arange(ctx, device=x.device)[None, :] <= positions[:, None]
            chosen = self.indexer.select(
                index_q[lo:hi], weights[lo:hi], rows[:, self.latent + self.rope :], visible
            )
            out[lo:hi] = self._attend(q[lo:hi], rows[:, : self.latent + self.rope], chosen)
        return self._project_out(out.reshape(num_tokens, self.num_heads * self.v_dim))

    def _context_rows(
        self, layer_cache: torch.Tensor, table: torch.Tensor, ctx: int, dtype: torch.dtype
    ) -> torch.Tensor:  # [ctx, latent + rope + index] in dtype
        """The cached rows of positions 0 .. ctx - 1; fp8 ones dequantized."""
        if not fp8_ds_mla.is_ds_mla(layer_cache.dtype):
            return gather_rows(layer_cache, table[None], [ctx], self.latent, dtype)
        size = layer_cache.shape[3]
        pos = torch.arange(ctx, device=layer_cache.device)
        raw = layer_cache[table.to(pos.device)[pos // size].long(), 0, 0, pos % size]
        return fp8_ds_mla.dequantize_indexed(raw, self.latent, self.indexer.head_dim, dtype)

    def _attend(
        self,
        q: torch.Tensor,  # [n, H, nope + rope]
        rows: torch.Tensor,  # [ctx, latent + rope]
        chosen: torch.Tensor,  # [n, ctx] bool
    ) -> torch.Tensor:  # [n, H, v]
        kv = self.kv_b_proj(rows[:, : self.latent]).view(-1, self.num_heads, self.nope + self.v_dim)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        k_rope = rows[:, None, self.latent :].expand(-1, self.num_heads, -1)
        k = torch.cat((k_nope, k_rope), dim=-1)  # [ctx, H, nope + rope]
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None],
            k.transpose(0, 1)[None],
            v.transpose(0, 1)[None],
            attn_mask=chosen[None, None],
            scale=self.scale,
        )  # [1, H, n, v]
        return o[0].transpose(0, 1)


def write_rows(
    layer_cache: torch.Tensor,  # [N, 1, 1, B, D]
    rows: torch.Tensor,  # [T, D]
    slot_mapping: torch.Tensor,  # [T] int64, block_id * B + offset; negative: padding
) -> None:
    block_size = layer_cache.shape[3]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    layer_cache[slots // block_size, 0, 0, slots % block_size] = rows[keep].to(layer_cache.dtype)


def sequences(meta: AttentionMetadata) -> list[tuple[int, int, int, torch.Tensor]]:
    """(first row, end row, context length, block table) of each sequence (or PCP piece) of
    the step: its queries are rows lo .. hi - 1 of the batch, the last of its ctx positions."""
    out = []
    nd = meta.num_decode_tokens
    for s, ctx in enumerate(meta.decode_context_lens[:nd].tolist()):
        out.append((s, s + 1, ctx, meta.decode_block_tables[s]))
    starts = meta.prefill_cu_seqlens_q.tolist()
    for s, ctx in enumerate(meta.prefill_context_lens.tolist()):
        if starts[s + 1] > starts[s]:
            out.append((nd + starts[s], nd + starts[s + 1], ctx, meta.prefill_block_tables[s]))
    return out
