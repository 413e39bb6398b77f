"""Llama-family decoder on a paged KV cache.

Module and parameter names follow Hugging Face's LlamaForCausalLM so a safetensors
checkpoint loads by name. Tokens arrive as one flat batch [T] of all scheduled sequences.

Tensor parallel (``parallel.tp_size > 1``): each rank holds its query heads and KV heads
(common/parallel/tp.py) and a slice of the MLP; q/k/v and gate/up are column-parallel, o_proj and
down_proj row-parallel followed by an all-reduce over the TP group. Embeddings, norms and
the LM head are replicated. :func:`shard_state_dict` cuts a full checkpoint to one rank.

Pointwise work goes through :mod:`pdserve.kernels` (Triton on CUDA: one launch per RMSNorm
with its residual add, per rotary embedding of q and k, per SiLU-and-mul; the torch
reference elsewhere, which is HF's arithmetic op for op). On CUDA, :meth:`pack_weights`
also packs q/k/v and gate/up into one matrix each (one GEMM instead of three, or two):
the per-layer launches of a decode step drop from ~45 to ~10. The parameters stay, as views
into the packed matrices, so the state dict keeps HF's names.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from pdserve import kernels
from pdserve.common.model.attention import AttentionMetadata, paged_attention
from pdserve.common.model.config import ModelConfig
from pdserve.common.model.linear import Linear
from pdserve.common.model.mla import MLAAttention, attention_shards
from pdserve.common.model.moe import SparseMoeBlock
from pdserve.common.model.norm import RMSNorm
from pdserve.common.model.rope import RotaryEmbedding
from pdserve.common.parallel.context import ParallelContext
from pdserve.common.parallel.tp import kv_heads_of, q_heads_of


def _pack(linears: list[nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One [sum(out), in] matrix (and bias) holding the linears' weights; each linear keeps
    its parameter as a view into it, so the state dict and the memory stay as they were."""
    weight = torch.cat([lin.weight.detach() for lin in linears])
    sizes = [lin.weight.shape[0] for lin in linears]
    for lin, part in zip(linears, weight.split(sizes), strict=True):
        lin.weight = nn.Parameter(part, requires_grad=False)
    if linears[0].bias is None:
        return weight, None
    bias = torch.cat([lin.bias.detach() for lin in linears])
    for lin, part in zip(linears, bias.split(sizes), strict=True):
        lin.bias = nn.Parameter(part, requires_grad=False)
    return weight, bias


class Attention(nn.Module):
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
        # packed (pack_weights): q/k/v as one GEMM, o_proj's (without its bias under TP)
        self.qkv: Linear | None = None
        self.o: Linear | None = None

    def pack(self, prepack: bool = False) -> None:
        self.qkv = Linear(*_pack([self.q_proj, self.k_proj, self.v_proj]), prepack)
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


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, par: ParallelContext) -> None:
        super().__init__()
        self.par = par
        bias = cfg.mlp_bias
        size = cfg.intermediate_size // par.tp_size
        self.gate_proj = nn.Linear(cfg.hidden_size, size, bias=bias)
        self.up_proj = nn.Linear(cfg.hidden_size, size, bias=bias)
        self.down_proj = nn.Linear(size, cfg.hidden_size, bias=bias)
        # packed (pack_weights): gate/up as one GEMM, down_proj's (without its bias under TP)
        self.gate_up: Linear | None = None
        self.down: Linear | None = None

    def pack(self, prepack: bool = False) -> None:
        self.gate_up = Linear(*_pack([self.gate_proj, self.up_proj]), prepack)
        down_bias = self.down_proj.bias if self.par.tp_size == 1 else None
        self.down = Linear(self.down_proj.weight, down_bias, prepack)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up is not None:
            h = kernels.silu_and_mul(self.gate_up(x))
        else:
            h = F.silu(self.gate_proj(x)) * self.up_proj(x)
        if self.par.tp_size == 1:
            return self.down(h) if self.down is not None else self.down_proj(h)
        # row-parallel: partial sums reduced, the bias added once after
        out = self.down(h) if self.down is not None else F.linear(h, self.down_proj.weight)
        out = self.par.all_reduce_tp(out)
        return out if self.down_proj.bias is None else out + self.down_proj.bias


def attention_for(cfg: ModelConfig, par: ParallelContext, layer: int) -> Attention | MLAAttention:
    """Layer ``layer``'s attention: MLA for DeepSeek V2/V3, else GQA (common/model/mla.py)."""
    return MLAAttention(cfg, par, layer) if cfg.is_mla else Attention(cfg, par, layer)


def mlp_for(cfg: ModelConfig, par: ParallelContext, layer: int) -> nn.Module:
    """Layer ``layer``'s MLP: the experts of a sparse layer (common/model/moe.py), else dense."""
    if cfg.moe is not None and cfg.is_moe_layer(layer):
        return SparseMoeBlock(cfg.hidden_size, cfg.moe, par)
    return MLP(cfg, par)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, par: ParallelContext, layer: int) -> None:
        super().__init__()
        self.self_attn = attention_for(cfg, par, layer)
        self.mlp = mlp_for(cfg, par, layer)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,  # the previous layer's MLP output (or the embeddings)
        residual: torch.Tensor | None,  # the residual stream before x is added (None: first layer)
        rope: tuple[torch.Tensor, torch.Tensor],
        layer_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # (MLP output, residual stream before it)
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm.add(x, residual)
        h = self.self_attn(h, rope, layer_cache, meta)
        h, residual = self.post_attention_layernorm.add(h, residual)
        return self.mlp(h), residual


class LlamaBackbone(nn.Module):
    def __init__(self, cfg: ModelConfig, par: ParallelContext) -> None:
        super().__init__()
        self.tp_size = par.tp_size
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.rotary = RotaryEmbedding(
            cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, cfg.max_position_embeddings
        )
        self.layers = nn.ModuleList(DecoderLayer(cfg, par, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, parallel: ParallelContext | None = None) -> None:
        super().__init__()
        self.config = cfg
        self.model = LlamaBackbone(cfg, parallel or ParallelContext())
        # per layer: (KV cache group, slot in its blocks); the engine sets them for a cache
        # of several groups (common/engine/kv_groups.py: layer_slots)
        self.kv_slots = [(0, i) for i in range(cfg.num_hidden_layers)]
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        # MTP speculation (common/engine/spec_decode/mtp.py): with keep_hidden, a forward
        # leaves the final hidden states before the final norm of its logits rows here
        self.keep_hidden = False
        self.hidden: torch.Tensor | None = None  # [S, hidden]
        self.head: Linear | None = None  # lm_head's GEMM, prepacked (pack_weights)

    def _layers(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:  # (last MLP output, residual before it)
        x = self.model.embed_tokens(input_ids)
        cos, sin = self.model.rotary.cos_sin(positions)
        rope = (cos.to(x.dtype), sin.to(x.dtype))  # once per step, not per layer
        residual: torch.Tensor | None = None
        for layer, (group, slot) in zip(self.model.layers, self.kv_slots, strict=True):
            x, residual = layer(x, residual, rope, kv_cache[:, slot], meta.of_group(group))
        return x, residual

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_cache: torch.Tensor,  # [N, L_page, 2, H_kv, B, D]
        meta: AttentionMetadata,
        logits_indices: torch.Tensor,  # [S] rows of the batch whose next token is sampled
    ) -> torch.Tensor:  # [S, vocab] float32
        x, residual = self._layers(input_ids, positions, kv_cache, meta)
        if residual is None:  # no layers
            pre = x[logits_indices]
            x = self.model.norm(pre)
        else:
            x, pre = self.model.norm.add(x[logits_indices], residual[logits_indices])
        if self.keep_hidden:
            self.hidden = pre
        return (self.head(x) if self.head is not None else self.lm_head(x)).float()

    def hidden_states(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [T, hidden]: every token's final hidden state before the final norm
        x, residual = self._layers(input_ids, positions, kv_cache, meta)
        return x if residual is None else x + residual

    def decode_splits(self, num_seqs: int, num_kv_heads: int, device: torch.device) -> int:
        """The decode kernel's split of a batch of ``num_seqs`` (``kernels.decode_splits``,
        for MLA ``kernels.mla_decode_splits`` over this rank's query heads)."""
        if self.config.is_mla:
            heads = q_heads_of(self.config.num_attention_heads, self.model.tp_size, 0)[1]
            return kernels.mla_decode_splits(num_seqs, heads, device)
        return kernels.decode_splits(num_seqs, num_kv_heads, device)

    def pack_weights(self, prepack: bool = False) -> None:
        """Pack q/k/v and gate/up of every layer: fewer, larger GEMMs. ``prepack`` (CPU,
        float32): every GEMM of the GQA layers and the LM head over oneDNN-reordered copies
        of its weights (common/model/linear.py)."""
        for layer in self.model.layers:
            assert isinstance(layer, DecoderLayer)
            if isinstance(layer.self_attn, Attention):
                layer.self_attn.pack(prepack)
            if isinstance(layer.mlp, MLP):
                layer.mlp.pack(prepack)
        if prepack:
            self.head = Linear(self.lm_head.weight, None, prepack)


def shard_state_dict(
    state: dict[str, torch.Tensor], cfg: ModelConfig, tp_size: int, tp_rank: int
) -> dict[str, torch.Tensor]:
    """The parameters TP rank ``tp_rank`` holds, cut from a full checkpoint."""
    if tp_size == 1:
        return state
    d = cfg.head_dim
    q0, nq = q_heads_of(cfg.num_attention_heads, tp_size, tp_rank)
    k0, nk = kv_heads_of(cfg.num_key_value_heads, tp_size, tp_rank)
    rows = {
        "q_proj": (q0 * d, nq * d),
        "k_proj": (k0 * d, nk * d),
        "v_proj": (k0 * d, nk * d),
    }
    cols = {"o_proj": (q0 * d, nq * d)}
    if cfg.is_mla:  # heads of q/q_b/kv_b and o_proj; the latent's projections replicated
        mla_rows, mla_cols = attention_shards(cfg, tp_size, tp_rank)
        rows.update(mla_rows)
        cols.update(mla_cols)
    out = {}
    for name, tensor in state.items():
        parts = name.split(".")
        proj, kind = (parts[-2], parts[-1]) if len(parts) >= 2 else ("", "")
        if proj in ("gate_proj", "up_proj"):  # dense or shared-expert MLP: its own size
            m = tensor.shape[0] // tp_size
            tensor = tensor.narrow(0, tp_rank * m, m)
        elif proj == "down_proj" and kind == "weight":
            m = tensor.shape[1] // tp_size
            tensor = tensor.narrow(1, tp_rank * m, m)
        elif proj in rows:
            start, size = rows[proj]
            tensor = tensor.narrow(0, start, size)
        elif proj in cols and kind == "weight":
            start, size = cols[proj]
            tensor = tensor.narrow(1, start, size)
        out[name] = tensor.contiguous()
    return out
