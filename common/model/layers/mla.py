"""Multi-head latent attention (DeepSeek V2/V3) on a paged latent cache.

Parameter names are transformers' ``DeepseekV3Attention``'s: ``q_proj`` (``q_lora_rank``
None) or ``q_a_proj`` -> ``q_a_layernorm`` -> ``q_b_proj``; ``kv_a_proj_with_mqa`` giving
the latent (``kv_lora_rank``, normed by ``kv_a_layernorm``) and the shared rope key
(``qk_rope_head_dim``); ``kv_b_proj`` expanding the latent into each head's key
(``qk_nope_head_dim``) and value (``v_head_dim``); ``o_proj``.

The cache holds, per token and layer, ``latent ++ rotated k_rope`` (one row of
``kv_lora_rank + qk_rope_head_dim``), the same on every TP rank; with ``--kv-cache-dtype
fp8`` that row as its 656-byte fp8_ds_mla record (kernels/fp8_ds_mla.py: fp8 latent, one
fp32 scale per 128 values, bf16 rope), quantized by the write and dequantized by the
reads. Attention:

* prefill expands the cached latent of the sequences into per-head K and V with
  ``kv_b_proj`` (as transformers does) and runs causal SDPA (common/model/layers/mla_prefill.py:
  batched expansion, v padded to the q/k width for flash attention): cheap at long prompts;
* decode uses the absorbed form: each query head's nope part goes into latent space
  through its slice of ``kv_b_proj`` (``W_UK``), attends the latent rows directly
  (``kernels.mla_decode_attention``: one KV head of width kv_lora_rank + rope, the value
  its latent prefix), and its output leaves latent space through ``W_UV``. Per step it reads
  the latent once for all heads instead of expanding the whole context.

Rope: DeepSeek V3 with ``rope_interleave`` (and V2 always) rotates interleaved pairs
(x0, x1), (x2, x3), ...; the pairs are de-interleaved first, after which it is the
rotate_half rotation of ``kernels.rotary`` (transformers' V3 computes exactly that; V2's
complex product differs only by the same permutation of q and k, which a dot product does
not see). Yarn's mscale enters the softmax scale (``ModelConfig.softmax_scale``).

Tensor parallel: q_proj / q_b_proj and kv_b_proj split by heads (column-parallel), o_proj
row-parallel (all-reduce, bias once); q_a_proj, kv_a_proj_with_mqa and both norms are
replicated, so every rank computes and caches the same latent.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from pdserve import kernels
from pdserve.common.model.checkpoint.config import ModelConfig
from pdserve.common.model.layers.attention import AttentionMetadata
from pdserve.common.model.layers.mla_prefill import mla_prefill
from pdserve.common.model.layers.norm import RMSNorm
from pdserve.common.parallel.context import ParallelContext
from pdserve.common.parallel.tp import q_heads_of

# transformers builds q_a_layernorm and kv_a_layernorm without config.rms_norm_eps
LATENT_NORM_EPS = 1e-6


class MLAAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, par: ParallelContext, layer: int) -> None:
        super().__init__()
        self.par = par
        self.num_heads = q_heads_of(cfg.num_attention_heads, par.tp_size, par.tp_rank)[1]
        self.nope, self.rope = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
        self.v_dim, self.latent = cfg.v_head_dim, cfg.kv_lora_rank
        self.interleave = cfg.rope_interleave
        self.scale = cfg.softmax_scale
        qk_dim = self.nope + self.rope
        hidden, bias = cfg.hidden_size, cfg.attention_bias
        self.q_proj: nn.Linear | None = None
        self.q_a_proj: nn.Linear | None = None
        self.q_a_layernorm: RMSNorm | None = None
        self.q_b_proj: nn.Linear | None = None
        if cfg.q_lora_rank is None:
            self.q_proj = nn.Linear(hidden, self.num_heads * qk_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(hidden, cfg.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(cfg.q_lora_rank, self.num_heads * qk_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden, self.latent + self.rope, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.latent, LATENT_NORM_EPS)
        self.kv_b_proj = nn.Linear(
            self.latent, self.num_heads * (self.nope + self.v_dim), bias=False
        )
        self.o_proj = nn.Linear(self.num_heads * self.v_dim, hidden, bias=cfg.o_proj_bias)

    def pack(self, prepack: bool = False) -> None:
        """Nothing to pack: the absorbed weights are views of kv_b_proj."""

    def _absorbed(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(W_UK [H, nope, latent], W_UV [H, v, latent]): views of kv_b_proj's weight."""
        w = self.kv_b_proj.weight.view(self.num_heads, self.nope + self.v_dim, self.latent)
        return w[:, : self.nope], w[:, self.nope :]

    def _rotate(
        self, q_rope: torch.Tensor, k_rope: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.interleave:  # pairs (x0, x1), ... -> [x0, x2, ..., x1, x3, ...]
            q_rope = q_rope.unflatten(-1, (-1, 2)).transpose(-1, -2).flatten(-2)
            k_rope = k_rope.unflatten(-1, (-1, 2)).transpose(-1, -2).flatten(-2)
        return kernels.rotary(q_rope.contiguous(), k_rope.contiguous(), *rope)

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]
        rope: tuple[torch.Tensor, torch.Tensor],  # cos, sin [T, rope]
        layer_cache: torch.Tensor,  # [N, 1, 1, B, latent + rope]
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [T, hidden]
        num_tokens = x.shape[0]
        if self.q_proj is not None:
            q = self.q_proj(x)
        else:
            assert self.q_a_proj and self.q_a_layernorm and self.q_b_proj
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(num_tokens, self.num_heads, self.nope + self.rope)
        q_nope, q_rope = q.split([self.nope, self.rope], dim=-1)
        latent, k_rope = self.kv_a_proj_with_mqa(x).split([self.latent, self.rope], dim=-1)
        latent = self.kv_a_layernorm(latent.contiguous())
        q_rope, k_rope = self._rotate(q_rope, k_rope[:, None, :], rope)
        row = torch.cat((latent, k_rope[:, 0]), dim=-1)  # [T, latent + rope]
        if meta.kv_gather is not None:  # PCP: every rank writes every new token's latent
            row = meta.kv_gather(row[None])[0]
        kernels.write_latent(layer_cache, row, meta.slot_mapping, self.latent)
        out = torch.empty(
            (num_tokens, self.num_heads, self.v_dim), dtype=x.dtype, device=x.device
        )  # [T, H, v]
        nd = meta.num_decode_tokens
        if nd:
            out[:nd] = self._decode(q_nope[:nd], q_rope[:nd], layer_cache, meta)
        if meta.num_prefills and num_tokens > nd:
            out[nd:] = self._prefill(q_nope[nd:], q_rope[nd:], layer_cache, meta)
        return self._project_out(out.reshape(num_tokens, self.num_heads * self.v_dim))

    def _project_out(self, out: torch.Tensor) -> torch.Tensor:  # [T, H * v] -> [T, hidden]
        """o_proj, row-parallel under TP: the partial sums all-reduced, the bias added once."""
        if self.par.tp_size == 1:
            return self.o_proj(out)
        out = self.par.all_reduce_tp(F.linear(out, self.o_proj.weight))
        return out if self.o_proj.bias is None else out + self.o_proj.bias

    def _decode(
        self,
        q_nope: torch.Tensor,  # [S, H, nope]
        q_rope: torch.Tensor,  # [S, H, rope]
        layer_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [S, H, v]
        w_uk, w_uv = self._absorbed()
        q_latent = torch.einsum("shn,hnl->shl", q_nope, w_uk)  # [S, H, latent]
        out = kernels.mla_decode_attention(
            torch.cat((q_latent, q_rope), dim=-1),
            layer_cache,
            meta.decode_context_lens,
            meta.decode_block_tables,
            self.scale,
            self.latent,
            meta.decode_splits,
        )  # [S, H, latent]
        return torch.einsum("shl,hvl->shv", out, w_uv)

    def _prefill(
        self,
        q_nope: torch.Tensor,  # [T_p, H, nope]
        q_rope: torch.Tensor,  # [T_p, H, rope]
        layer_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [T_p, H, v]
        """The cached latent expanded into per-head K and V, causal SDPA
        (common/model/layers/mla_prefill.py)."""
        return mla_prefill(
            q_nope, q_rope, layer_cache, meta, self.kv_b_proj, self.latent, self.v_dim, self.scale
        )


def attention_shards(
    cfg: ModelConfig, tp_size: int, tp_rank: int
) -> tuple[dict[str, tuple[int, int]], dict[str, tuple[int, int]]]:
    """(rows, cols): the (start, size) slices of TP rank ``tp_rank`` of the MLA projections
    split by heads, rows of the column-parallel ones, columns of o_proj."""
    q0, nq = q_heads_of(cfg.num_attention_heads, tp_size, tp_rank)
    qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    kv = cfg.qk_nope_head_dim + cfg.v_head_dim
    rows = {
        "q_proj": (q0 * qk, nq * qk),
        "q_b_proj": (q0 * qk, nq * qk),
        "kv_b_proj": (q0 * kv, nq * kv),
    }
    cols = {"o_proj": (q0 * cfg.v_head_dim, nq * cfg.v_head_dim)}
    return rows, cols
