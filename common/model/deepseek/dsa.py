"""DeepSeek sparse attention (DeepSeek-V3.2): MLA whose queries attend only the cached
tokens a lightning indexer selects.

Parameter names are transformers' ``DeepseekV32Attention``'s: the MLA projections of
common/model/layers/mla.py (q always low-rank) plus ``indexer.wq_b`` (the indexer's queries from
the MLA's normed ``q_a`` output), ``indexer.wk`` and ``indexer.k_norm`` (a LayerNorm: its
one key per token), ``indexer.weights_proj`` (a weight per indexer head and token).

The indexer's score of key t for the query at position p is
``sum_h w[p, h] * relu(q[p, h] . k[t]) * index_head_dim^-0.5 * index_n_heads^-0.5`` over
its heads, in float32; the query attends the ``index_topk`` visible keys (t <= p) of the
highest scores, all of them while there are fewer. Its rope is the non-interleaved one over
the first ``qk_rope_head_dim`` values of each head (the MLA's is interleaved).

The cache row of a token is the MLA latent, its rope key, then the indexer's key
(common/engine/latent_format.py: ``index_dim``), written with every new token
(``kernels.write_cache_rows``), gathered from every PCP rank first like the latent; with
``--kv-cache-dtype fp8`` that row is stored as its fp8_ds_mla record followed by the key's
fp8 form (kernels/fp8_ds_mla.py ``quantize_indexed``), quantized (in torch) on write and
dequantized by the kernels as they read it.

Attention is two batched ops over the whole step, no loop over sequences and no host read
(``StepQueries``: each query's sequence and visible positions from the metadata by tensor
ops, so CUDA graphs capture a decode step): ``kernels.indexer_topk`` picks each query's
``index_topk`` keys (kernels/indexer_ref.py on CPU, kernels/triton_indexer.py on CUDA), then
``kernels.sparse_mla_attention`` attends them in the absorbed form of MLA decode (q_nope
through ``W_UK`` into latent space with q_rope; the latent rows as values, out through
``W_UV``), prefill and decode alike (kernels/sparse_mla_ref.py, triton_sparse_mla.py).

Tensor parallel: the MLA heads split as in common/model/layers/mla.py; the indexer is replicated,
so every rank selects the same keys.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from pdserve import kernels
from pdserve.common.model.checkpoint.config import ModelConfig
from pdserve.common.model.layers.attention import AttentionMetadata
from pdserve.common.model.layers.mla import MLAAttention
from pdserve.common.parallel.context import ParallelContext
from pdserve.kernels import KeyFormat, fp8_ds_mla

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
        cache = layer_cache[:, 0, 0]  # [N, B, row]
        kernels.write_cache_rows(cache, row, meta.slot_mapping)
        if num_tokens == 0:  # a PCP rank with no piece of this step still joined the gather
            return self._project_out(x.new_zeros((0, self.num_heads * self.v_dim)))
        step = StepQueries.once_a_step(meta, rope[0], num_tokens)
        fmt = KeyFormat.v32(
            self.latent,
            self.rope,
            self.indexer.head_dim,
            fp8=fp8_ds_mla.is_ds_mla(layer_cache.dtype),
        )
        chosen = kernels.indexer_topk(
            index_q,
            weights,
            cache,
            fmt,
            step.block_tables,
            step.query_seq,
            step.num_visible,
            self.indexer.topk,
            step.row_keys,
        )  # [T, topk]
        w_uk, w_uv = self._absorbed()
        q_latent = torch.einsum("thn,hnl->thl", q_nope, w_uk)  # [T, H, latent]
        out = kernels.sparse_mla_attention(
            torch.cat((q_latent, q_rope), dim=-1),
            cache,
            self.latent,
            step.block_tables,
            step.query_seq,
            chosen,
            self.scale,
        )  # [T, H, latent]
        out = torch.einsum("thl,hvl->thv", out, w_uv)
        return self._project_out(out.reshape(num_tokens, self.num_heads * self.v_dim))


# the last StepQueries built on each thread (PCP ranks may be threads of one process)
_LAST = threading.local()


@dataclass(frozen=True)
class StepQueries:
    """Each query token of a step: its sequence's row of ``block_tables`` (the decode
    sequences', then the prefill sequences' or PCP pieces') and how many positions it sees
    (its own, plus one). Built from the metadata by tensor ops alone: no host read, no loop
    over sequences (a CUDA graph captures it)."""

    block_tables: torch.Tensor  # [S_d + S_p, max_blocks] int32
    query_seq: torch.Tensor  # [T] int32
    num_visible: torch.Tensor  # [T] int32
    # [T] int32: the keys its sequence has at the step's end, the width transformers ranks
    # the query's scores over (a PCP piece's query too: kernels.indexer_topk row_keys)
    row_keys: torch.Tensor

    @staticmethod
    def once_a_step(meta: AttentionMetadata, step_token: object, num_tokens: int) -> StepQueries:
        """``of`` once a step, for every layer: the last one built (on this thread) again
        while ``meta`` and ``step_token`` (the step's rope tensor, made anew by each
        forward, a CUDA graph's capture included) are the same objects."""
        last = getattr(_LAST, "entry", None)
        if last is not None and last[0] is meta and last[1] is step_token and last[2] == num_tokens:
            return last[3]
        step = StepQueries.of(meta, num_tokens)
        _LAST.entry = (meta, step_token, num_tokens, step)
        return step

    @staticmethod
    def of(meta: AttentionMetadata, num_tokens: int) -> StepQueries:
        nd = meta.num_decode_tokens
        device = meta.slot_mapping.device
        seqs, visible, tables = [], [], []
        if nd:
            seqs.append(torch.arange(nd, device=device))
            visible.append(meta.decode_context_lens[:nd].long())
            tables.append(meta.decode_block_tables[:nd])
        if num_tokens > nd:
            cu = meta.prefill_cu_seqlens_q.to(device).long()  # [S_p + 1]
            j = torch.arange(num_tokens - nd, device=device)
            seq = torch.searchsorted(cu[1:], j, right=True)  # the run holding token j
            q_len = cu[seq + 1] - cu[seq]
            ctx = meta.prefill_context_lens.to(device).long()[seq]
            seqs.append(seq + nd)
            visible.append(ctx - q_len + (j - cu[seq]) + 1)
            tables.append(meta.prefill_block_tables)
        width = max(t.shape[1] for t in tables)
        table = torch.cat([F.pad(t.to(device).int(), (0, width - t.shape[1])) for t in tables])
        query_seq = torch.cat(seqs)
        row_keys = meta.seq_ends().to(device)[query_seq]
        return StepQueries(table, query_seq.int(), torch.cat(visible).int(), row_keys.int())
