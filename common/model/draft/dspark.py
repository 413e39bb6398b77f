"""DSpark's draft module (DeepSeek's DeepSpec, ``Qwen3DSparkModel``), our own implementation
of its arithmetic for inference, loaded from a DeepSpec checkpoint directory by name.

What it computes, for a sequence whose last token ``t_s`` sits at position s (not yet
through the target) and whose positions < s the target has computed:

* context: per position p < s the target's residual streams after the layers
  ``target_layer_ids`` names (-1: the embeddings), side by side [L * hidden], made one
  ``c_p = hidden_norm(fc(features_p))``. Every draft layer's keys and values of position p
  are ``k_norm(k_proj(c_p))`` (RoPE at p) and ``v_proj(c_p)``: they depend on position p
  alone, so they live in a paged cache like the target's (:meth:`DSparkDraft.context_kv`).
* the block: ``block_size`` positions s .. s + B - 1 fed ``t_s`` then ``mask_token_id``;
  each draft layer is a Qwen3 decoder layer whose queries (the block's) attend, without a
  causal mask, to the context's keys and to all of the block's own keys. Block row i,
  after the final norm, predicts the token at s + i + 1 (:meth:`DSparkDraft.block`).
* logits ``lm_head(h_i)`` plus, with a Markov head, a bias from the token before
  (``t_s`` for row 0, then the previous draft): vanilla ``w2(w1[prev])``, gated
  ``w2(sigmoid(gate_proj([h_i, w1[prev]])) * w1[prev])``, or a recurrent state over the
  block (``rnn``); the confidence head ``proj([h_i, w1[prev]])`` (or ``proj(h_i)``), whose
  sigmoid estimates whether the draft survives verification.

Parameter names are DeepSpec's (``layers.N.self_attn.q_proj``, ``fc``, ``hidden_norm``,
``markov_head.markov_w1``, ``confidence_head.proj``), so its safetensors load as saved.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, cast

import msgspec
import torch
from torch import nn
from torch.nn import functional as F

from pdserve import kernels
from pdserve.common.errors import ModelLoadError
from pdserve.common.model.checkpoint.config import ModelConfig
from pdserve.common.model.layers.mlp import MLP
from pdserve.common.model.layers.norm import RMSNorm
from pdserve.common.model.layers.rope import RotaryEmbedding
from pdserve.common.parallel.context import ParallelContext

ARCHITECTURE = "Qwen3DSparkModel"
MARKOV_HEADS = ("vanilla", "gated", "rnn")


class DSparkConfig(msgspec.Struct, frozen=True, kw_only=True):
    layers: ModelConfig  # the draft's decoder layers (a Qwen3 shape, its own layer count)
    block_size: int
    mask_token_id: int
    target_layer_ids: tuple[int, ...]
    num_target_layers: int
    markov_rank: int = 0
    markov_head_type: str = "vanilla"
    enable_confidence_head: bool = False
    confidence_head_with_markov: bool = False

    @classmethod
    def from_dir(cls, path: Path) -> DSparkConfig:
        try:
            raw = json.loads((path / "config.json").read_text())
        except (OSError, ValueError) as exc:
            raise ModelLoadError(
                f"DSpark draft: cannot read {path / 'config.json'}: {exc}"
            ) from exc
        arch = (raw.get("architectures") or [None])[0]
        if arch != ARCHITECTURE:
            raise ModelLoadError(
                f"DSpark draft {path}: architecture {arch!r} is not supported; pdserve drafts "
                f"with DeepSpec's {ARCHITECTURE} (Qwen3 targets)"
            )
        try:
            layers = ModelConfig.from_dict(
                {**raw, "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
                 "layer_types": None, "sliding_window": None, "use_sliding_window": False}
            )  # fmt: skip
            markov_rank = int(raw.get("markov_rank", 0))
            cfg = cls(
                layers=layers,
                block_size=int(raw["block_size"]),
                mask_token_id=int(raw["mask_token_id"]),
                target_layer_ids=tuple(int(i) for i in raw["target_layer_ids"]),
                num_target_layers=int(raw["num_target_layers"]),
                markov_rank=markov_rank,
                markov_head_type=str(raw.get("markov_head_type", "vanilla")).lower(),
                enable_confidence_head=bool(raw.get("enable_confidence_head", False)),
                confidence_head_with_markov=bool(raw.get("confidence_head_with_markov", False)),
            )
        except KeyError as exc:
            raise ModelLoadError(f"DSpark draft {path}: config.json lacks the key {exc}") from exc
        if cfg.markov_rank and cfg.markov_head_type not in MARKOV_HEADS:
            raise ModelLoadError(
                f"DSpark draft {path}: markov_head_type {cfg.markov_head_type!r} is not one of "
                f"{', '.join(MARKOV_HEADS)}"
            )
        if cfg.confidence_head_with_markov and cfg.enable_confidence_head and not markov_rank:
            raise ModelLoadError(
                f"DSpark draft {path}: confidence_head_with_markov needs a Markov head "
                "(markov_rank > 0)"
            )
        return cfg


class MarkovHead(nn.Module):
    """A bias on each block row's logits from the token before it (DeepSpec's names)."""

    def __init__(self, kind: str, vocab: int, rank: int, hidden: int) -> None:
        super().__init__()
        self.kind = kind
        self.rank = rank
        self.markov_w1 = nn.Embedding(vocab, rank)
        self.markov_w2 = nn.Linear(rank, vocab, bias=False)
        if kind == "gated":
            self.gate_proj = nn.Linear(hidden + rank, rank)
        elif kind == "rnn":  # [state, w1[prev], h] -> [gate, candidate, output]
            self.joint_proj = nn.Linear(2 * rank + hidden, 3 * rank)

    def bias(
        self,
        embed: torch.Tensor,  # [S, r]: w1 of the token before each row
        h: torch.Tensor,  # [S, hidden]
        state: torch.Tensor | None,  # [S, r]: rnn's, None at the block's first row
    ) -> tuple[torch.Tensor, torch.Tensor | None]:  # ([S, V], the next state)
        if self.kind == "vanilla":
            return self.markov_w2(embed), None
        if self.kind == "gated":
            gate = torch.sigmoid(self.gate_proj(torch.cat([h, embed], -1)))
            return self.markov_w2(gate * embed), None
        state = torch.zeros_like(embed) if state is None else state
        gate, cand, out = self.joint_proj(torch.cat([state, embed, h], -1)).chunk(3, dim=-1)
        gate = torch.sigmoid(gate)
        state = gate * state + (1.0 - gate) * torch.tanh(cand)
        return self.markov_w2(torch.tanh(out)), state


class ConfidenceHead(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.proj = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [S, width] -> [S] logits
        return self.proj(x).squeeze(-1).float()


class DSparkAttention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        d = self.head_dim = cfg.head_dim
        self.num_heads, self.num_kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(cfg.hidden_size, self.num_heads * d, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * d, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * d, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * d, cfg.hidden_size, bias=bias)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps)

    def kv(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:  # [T, hidden] -> k (RoPE'd), v [T, H_kv, D]
        d = self.head_dim
        k = self.k_norm(self.k_proj(x).reshape(-1, d)).view(x.shape[0], self.num_kv_heads, d)
        v = self.v_proj(x).view(x.shape[0], self.num_kv_heads, d)
        cos, sin = rope[0][:, None, :], rope[1][:, None, :]
        half = d // 2
        return k * cos + torch.cat((-k[..., half:], k[..., :half]), -1) * sin, v

    def forward(
        self,
        x: torch.Tensor,  # [S * B, hidden]: the blocks' rows, normed
        rope: tuple[torch.Tensor, torch.Tensor],  # of the block positions [S * B, D]
        context: list[tuple[torch.Tensor, torch.Tensor]],  # per seq its context's k, v [n, H_kv, D]
    ) -> torch.Tensor:  # [S * B, hidden]
        d, rows = self.head_dim, x.shape[0]
        q = self.q_norm(self.q_proj(x).reshape(-1, d)).view(rows, self.num_heads, d)
        k = self.k_norm(self.k_proj(x).reshape(-1, d)).view(rows, self.num_kv_heads, d)
        v = self.v_proj(x).view(rows, self.num_kv_heads, d)
        q, k = kernels.rotary(q, k, *rope)
        size = rows // len(context)
        out = torch.empty_like(q)
        for i, (ck, cv) in enumerate(context):  # contexts differ in length: one seq a call
            blk = slice(i * size, (i + 1) * size)
            keys = torch.cat([ck, k[blk]]).transpose(0, 1)  # [H_kv, n + B, D]
            values = torch.cat([cv, v[blk]]).transpose(0, 1)
            o = F.scaled_dot_product_attention(
                q[blk].transpose(0, 1), keys, values, scale=d**-0.5, enable_gqa=True
            )  # [H, B, D]: every row sees the whole context and the whole block
            out[blk] = o.transpose(0, 1)
        return self.o_proj(out.reshape(rows, self.num_heads * d))


class DSparkLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.self_attn = DSparkAttention(cfg)
        self.mlp = MLP(cfg, ParallelContext())
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        context: list[tuple[torch.Tensor, torch.Tensor]],
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), rope, context)
        return x + self.mlp(self.post_attention_layernorm(x))


class DSparkDraft(nn.Module):
    def __init__(self, cfg: DSparkConfig) -> None:
        super().__init__()
        self.cfg = cfg
        c = cfg.layers
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(DSparkLayer(c) for _ in range(c.num_hidden_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.fc = nn.Linear(len(cfg.target_layer_ids) * c.hidden_size, c.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.lm_head = nn.Linear(c.hidden_size, c.vocab_size, bias=False)
        self.rotary = RotaryEmbedding(
            c.head_dim, c.rope_theta, c.rope_scaling, c.max_position_embeddings
        )
        self.markov_head = (
            MarkovHead(cfg.markov_head_type, c.vocab_size, cfg.markov_rank, c.hidden_size)
            if cfg.markov_rank > 0
            else None
        )
        with_markov = cfg.confidence_head_with_markov and self.markov_head is not None
        self.confidence_head = (
            ConfidenceHead(c.hidden_size + (cfg.markov_rank if with_markov else 0))
            if cfg.enable_confidence_head
            else None
        )

    def rope(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self.rotary.cos_sin(positions)
        return cos.to(dtype), sin.to(dtype)

    def context_kv(
        self, features: torch.Tensor, positions: torch.Tensor
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per draft layer the keys and values [T, H_kv, D] of context positions
        ``positions`` [T] from the target's features there [T, L * hidden]."""
        ctx = self.hidden_norm(self.fc(features))  # [T, hidden]
        rope = self.rope(positions, ctx.dtype)
        return [cast(DSparkLayer, layer).self_attn.kv(ctx, rope) for layer in self.layers]

    def block(
        self,
        anchors: torch.Tensor,  # [S]: each sequence's last token t_s
        positions: torch.Tensor,  # [S]: its position s
        context: list[list[tuple[torch.Tensor, torch.Tensor]]],  # [layer][seq] k, v [n, H, D]
    ) -> torch.Tensor:  # [S, B, hidden]: each block row after the final norm
        num, size = anchors.shape[0], self.cfg.block_size
        ids = torch.full((num, size), self.cfg.mask_token_id, dtype=torch.long,
                         device=anchors.device)  # fmt: skip
        ids[:, 0] = anchors
        x = self.embed_tokens(ids.view(-1))  # [S * B, hidden]
        pos = (positions[:, None] + torch.arange(size, device=anchors.device)).view(-1)
        rope = self.rope(pos, x.dtype)
        for layer, ctx in zip(self.layers, context, strict=True):
            x = layer(x, rope, ctx)
        return self.norm(x).view(num, size, -1)

    def prev_embed(self, prev: torch.Tensor) -> torch.Tensor | None:  # [S] -> [S, r]
        return None if self.markov_head is None else self.markov_head.markov_w1(prev)

    def row_logits(
        self,
        h: torch.Tensor,  # [S, hidden]: block row i
        embed: torch.Tensor | None,  # [S, r]: prev_embed of the token before row i
        state: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:  # ([S, V] float32, the Markov state)
        logits = self.lm_head(h)
        if self.markov_head is not None:
            assert embed is not None
            bias, state = self.markov_head.bias(embed, h, state)
            logits = logits + bias
        return logits.float(), state

    def confidence(self, h: torch.Tensor, embed: torch.Tensor | None) -> torch.Tensor | None:
        """[S] logits of row i's survival, None without a confidence head."""
        if self.confidence_head is None:
            return None
        if self.cfg.confidence_head_with_markov and embed is not None:
            return self.confidence_head(torch.cat([h, embed.to(h.dtype)], -1))
        return self.confidence_head(h)


def load_dspark(path: Path, dtype: torch.dtype, device: torch.device) -> DSparkDraft:
    """The draft of a DeepSpec checkpoint directory (config.json, *.safetensors)."""
    from safetensors.torch import load_file

    cfg = DSparkConfig.from_dir(path)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"DSpark draft {path}: no *.safetensors file")
    state: dict[str, Any] = {}
    for f in files:
        state.update(load_file(str(f)))
    state = {k: v for k, v in state.items() if not k.startswith("rotary_emb.")}
    with torch.device("meta"):
        draft = DSparkDraft(cfg)
    missing = set(draft.state_dict()) - set(state)
    unexpected = set(state) - set(draft.state_dict())
    if missing or unexpected:
        raise ModelLoadError(
            f"DSpark draft {path}: tensors missing {sorted(missing)[:5]}, unexpected "
            f"{sorted(unexpected)[:5]}"
        )
    draft.load_state_dict(state, assign=True)
    draft = draft.to(device=device, dtype=dtype).eval().requires_grad_(False)
    c = cfg.layers  # RoPE's frequencies stay float32 whatever the weights' dtype
    draft.rotary = RotaryEmbedding(
        c.head_dim, c.rope_theta, c.rope_scaling, c.max_position_embeddings
    ).to(device)
    return draft
