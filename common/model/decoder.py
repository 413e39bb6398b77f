"""A decoder-only causal LM on a paged KV cache, over the layers its family picks.

Every family runs this one stack: embeddings, decoder layers (pre-norm attention, then a
pre-norm MLP, each added to the residual stream), a final norm and the LM head. A family's
module (common/model/families/) chooses each layer's parts, the attention
(``GQAAttention`` in common/model/layers/gqa.py, ``MLAAttention`` in common/model/layers/mla.py) and the
MLP (``MLP`` or a ``SparseMoeBlock``, common/model/layers/mlp.py), and builds the model.
Module and parameter names follow Hugging Face's ``*ForCausalLM`` (``model.embed_tokens``,
``model.layers.N.self_attn``/``mlp``/``input_layernorm``/``post_attention_layernorm``,
``model.norm``, ``lm_head``), so a safetensors checkpoint loads by name. Tokens arrive as
one flat batch [T] of all scheduled sequences.

Tensor parallel (``parallel.tp_size > 1``): the attention and MLP parts split their heads
and matrices over the TP group; embeddings, norms and the LM head are replicated.
:func:`shard_state_dict` cuts a full checkpoint to one rank.

Pointwise work goes through :mod:`pdserve.kernels` (Triton on CUDA: one launch per RMSNorm
with its residual add, per rotary embedding, per SiLU-and-mul; the torch reference
elsewhere, which is HF's arithmetic op for op). On CUDA, :meth:`CausalLM.pack_weights`
packs q/k/v and gate/up into one matrix each: the per-layer launches of a decode step drop
from ~45 to ~10.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol, cast

import torch
from torch import nn

from pdserve import kernels
from pdserve.common.model.checkpoint.config import ModelConfig
from pdserve.common.model.layers import gqa, mla
from pdserve.common.model.layers.attention import AttentionMetadata
from pdserve.common.model.layers.linear import Linear
from pdserve.common.model.layers.norm import RMSNorm
from pdserve.common.model.layers.rope import RotaryEmbedding
from pdserve.common.parallel.context import ParallelContext
from pdserve.common.parallel.tp import q_heads_of

# A part of layer N of a decoder: (config, this rank's place, N) -> its attention or MLP.
# The attention's forward takes (x [T, hidden], rope (cos, sin), layer_cache, meta); the
# MLP's (x [T, hidden]); both return [T, hidden], reduced over the TP group. Both pack.
LayerPart = Callable[[ModelConfig, ParallelContext, int], nn.Module]


class Packs(Protocol):
    def pack(self, prepack: bool = False) -> None:
        """Fewer, larger GEMMs (q/k/v, gate/up as one matrix); with ``prepack`` over
        oneDNN-reordered weights (common/model/layers/linear.py). A no-op where nothing packs (MLA,
        the experts)."""


def pack_part(part: nn.Module, prepack: bool = False) -> None:
    cast(Packs, part).pack(prepack)


class DecoderLayer(nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        par: ParallelContext,
        layer: int,
        attention: LayerPart,
        mlp: LayerPart,
    ) -> None:
        super().__init__()
        self.self_attn = attention(cfg, par, layer)
        self.mlp = mlp(cfg, par, layer)
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


class Backbone(nn.Module):
    def __init__(
        self, cfg: ModelConfig, par: ParallelContext, attention: LayerPart, mlp: LayerPart
    ) -> None:
        super().__init__()
        self.tp_size = par.tp_size
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.rotary = RotaryEmbedding(
            cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, cfg.max_position_embeddings
        )
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, par, i, attention, mlp) for i in range(cfg.num_hidden_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


def layer_slots(groups: Sequence[Sequence[int]], num_layers: int) -> list[tuple[int, int]]:
    """Per layer: (its group, its slot in that group's blocks), from each group's layers."""
    slots: list[tuple[int, int]] = [(0, i) for i in range(num_layers)]
    for g, layers in enumerate(groups):
        for j, layer in enumerate(layers):
            slots[layer] = (g, j)
    return slots


class CausalLM(nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        parallel: ParallelContext | None,
        attention: LayerPart,
        mlp: LayerPart,
    ) -> None:
        super().__init__()
        self.config = cfg
        # the parts every layer is built of: an MTP layer of this model is built of them too
        # (common/model/draft/mtp_layer.py)
        self.layer_parts = (attention, mlp)
        self.model = Backbone(cfg, parallel or ParallelContext(), attention, mlp)
        # per layer: (KV cache group, slot in its blocks); the engine sets them for a cache
        # of several groups (common/engine/kv_groups.py: layer_slots)
        self.kv_slots = [(0, i) for i in range(cfg.num_hidden_layers)]
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        # MTP speculation (common/engine/spec_decode/mtp.py): with keep_hidden, a forward
        # leaves the final hidden states before the final norm of its logits rows here;
        # with hidden_layers too (DSpark, common/engine/spec_decode/dspark.py) the residual
        # stream after each layer named there instead (-1: the embeddings), side by side
        self.keep_hidden = False
        self.hidden_layers: tuple[int, ...] | None = None
        self.hidden: torch.Tensor | None = None  # [S, hidden] or [S, len(layers) * hidden]
        self._taps: list[torch.Tensor] = []  # the last forward's streams of hidden_layers
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
        taps = self.hidden_layers if self.keep_hidden else None
        self._taps = [x] if taps and taps[0] == -1 else []
        for i, (layer, (group, slot)) in enumerate(
            zip(self.model.layers, self.kv_slots, strict=True)
        ):
            x, residual = layer(x, residual, rope, kv_cache[:, slot], meta.of_group(group))
            if taps and i in taps:
                self._taps.append(x + residual)  # HF's hidden_states[i + 1]
        return x, residual

    def place_kv(self, groups: Sequence[tuple[Sequence[int], int]]) -> None:
        """Where each layer's KV lives, from the engine's cache groups in order
        (common/engine/kv_groups.py cache_groups): each group's layers and tokens per slot."""
        self.kv_slots = layer_slots([layers for layers, _ in groups], self.config.num_hidden_layers)

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
            self.hidden = (
                torch.cat([t[logits_indices] for t in self._taps], -1) if self._taps else pre
            )
            self._taps = []
        return (self.head(x) if self.head is not None else self.lm_head(x)).float()

    def hidden_states(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [T, hidden]: every token's final hidden state before the final norm
        """(with keep_hidden and hidden_layers: [T, len(layers) * hidden], those layers'
        outputs, as ``hidden`` holds them for logits rows)."""
        x, residual = self._layers(input_ids, positions, kv_cache, meta)
        if self._taps:
            taps, self._taps = self._taps, []
            return torch.cat(taps, -1)
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
        of its weights (common/model/layers/linear.py)."""
        for layer in self.model.layers:
            assert isinstance(layer, DecoderLayer)
            pack_part(layer.self_attn, prepack)
            pack_part(layer.mlp, prepack)
        if prepack:
            self.head = Linear(self.lm_head.weight, None, prepack)


def shard_state_dict(
    state: dict[str, torch.Tensor], cfg: ModelConfig, tp_size: int, tp_rank: int
) -> dict[str, torch.Tensor]:
    """The parameters TP rank ``tp_rank`` holds, cut from a full checkpoint."""
    if tp_size == 1:
        return state
    # heads of q/k/v (GQA) or of q/q_b/kv_b (MLA; the latent's projections replicated), and
    # of o_proj
    shards = mla.attention_shards if cfg.is_mla else gqa.attention_shards
    rows, cols = shards(cfg, tp_size, tp_rank)
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
