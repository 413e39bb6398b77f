"""DSpark's draft module as DeepSeek-V4 checkpoints carry it under ``mtp.*`` (V4-Flash-DSpark,
V4-Flash-0731: our own implementation of the official ``inference/model.py`` arithmetic,
``DSparkBlock`` and ``DSparkAttention``; DeepSpec itself ships no V4 code).

config.json names it: ``dspark_block_size`` (B, 5), ``dspark_noise_token_id`` (the mask
token), ``dspark_target_layer_ids`` ([40, 41, 42] of 43 layers), ``dspark_markov_rank``
(256); the stages are the checkpoint's ``mtp.0 .. mtp.{n-1}`` (3; the HF config's
``num_nextn_predict_layers`` says 1, so they are counted from the tensors).

For a sequence whose last token ``t_s`` sits at position s (not yet through the target):

* context: per position p < s, ``main_hidden_p`` is the target's streams after each target
  layer (its output), averaged over the hyper-connection streams, side by side;
  ``main_x_p = mtp.0.main_norm(mtp.0.main_proj(main_hidden_p))``; each stage's context row
  is ``kv_norm(wkv(main_x_p))`` rotated at p (one K=V row, as the target's attention). A
  stage sees the last ``sliding_window`` (128) of them: positions [s - W, s).
* the block: B rows at s .. s + B - 1 fed ``t_s`` then the noise token, expanded to
  ``hc_mult`` streams, through every stage: a V4 block (hyper-connections, attention, its
  experts) whose queries see the context rows and all of the block's own rows (no causal
  mask, sinks, the values' rotation undone, grouped output projection); then the last
  stage's ``hc_head_*`` collapses the streams (``x``).
* row i predicts the token at s + i + 1: ``head(norm(x_i))`` (the target's LM head) plus
  the Markov bias ``markov_w2(markov_w1[prev])`` (prev: ``t_s`` for row 0, then the draft
  before); confidence ``confidence_head.proj([x_i, markov_w1[prev]])`` (x before the norm).

Module names are the checkpoint's (``mtp.N.attn.wq_a``, ``mtp.N.attn.kv_norm``,
``mtp.N.ffn.experts.E.w1``, ``mtp.0.main_proj``, ``mtp.2.markov_head.markov_w1`` ...); the
embeddings and the LM head are the target's, shared, not copied.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, cast

import msgspec
import torch
from torch import nn
from torch.nn import functional as F

from pdserve.common.errors import ModelLoadError
from pdserve.common.model.checkpoint.config import ModelConfig
from pdserve.common.model.deepseek.dsv4 import Expert, Gate, hyper_weights
from pdserve.common.model.deepseek.dsv4_attention import RMSNorm, Rope, rms
from pdserve.common.model.deepseek.dsv4_config import V4Config
from pdserve.kernels import v4_ops

KEYS = ("dspark_block_size", "dspark_noise_token_id", "dspark_target_layer_ids")
_STAGE = re.compile(r"^mtp\.(\d+)\.")


class V4DSparkConfig(msgspec.Struct, frozen=True, kw_only=True):
    block_size: int
    mask_token_id: int  # dspark_noise_token_id
    target_layer_ids: tuple[int, ...]
    markov_rank: int
    num_stages: int
    window: int  # the context rows a stage sees (the target's sliding_window)
    num_experts: int
    top_k: int


class DraftAttention(nn.Module):
    """A stage's attention: V4's shared-KV MQA (one K=V row a position), queries from the
    block, keys from the context rows and the block."""

    def __init__(self, target: ModelConfig, v4: V4Config) -> None:
        super().__init__()
        d = self.head_dim = target.head_dim
        self.num_heads, self.groups = target.num_attention_heads, v4.o_groups
        self.eps = target.rms_norm_eps
        hidden = target.hidden_size
        self.wq_a = nn.Linear(hidden, v4.q_lora_rank, bias=False)
        self.q_norm = RMSNorm(v4.q_lora_rank, target.rms_norm_eps)
        self.wq_b = nn.Linear(v4.q_lora_rank, self.num_heads * d, bias=False)
        self.wkv = nn.Linear(hidden, d, bias=False)
        self.kv_norm = RMSNorm(d, target.rms_norm_eps)
        self.wo_a = nn.Linear(self.num_heads * d // v4.o_groups, v4.o_groups * v4.o_lora_rank,
                              bias=False)  # fmt: skip
        self.wo_b = nn.Linear(v4.o_groups * v4.o_lora_rank, hidden, bias=False)
        self.attn_sink = nn.Parameter(torch.zeros(self.num_heads))

    def rows(
        self, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]
    ) -> torch.Tensor:  # [T, hidden] -> [T, D]: K=V rows rotated at their positions
        return Rope.apply(self.kv_norm(self.wkv(x)), *cos_sin)

    def forward(
        self,
        x: torch.Tensor,  # [S * B, hidden]: the blocks' rows, normed
        cos_sin: tuple[torch.Tensor, torch.Tensor],  # of the block rows' positions
        context: list[torch.Tensor],  # per sequence its context rows [n, D]
    ) -> torch.Tensor:  # [S * B, hidden]
        rows, d = x.shape[0], self.head_dim
        q = rms(self.wq_b(self.q_norm(self.wq_a(x))).view(rows, self.num_heads, d), self.eps)
        q = Rope.apply(q, *cos_sin)
        kv = self.rows(x, cos_sin)  # [S * B, D]
        # every row sees its sequence's context rows and its whole block: one call of V4's
        # attention op over the rows laid out as a cache of one-row blocks
        size = rows // len(context)
        lens = [c.shape[0] for c in context]  # host: the tensors' shapes
        keys = torch.cat([c.to(kv.dtype) for c in context] + [kv])  # [sum n + S * B, D]
        longest = max(lens, default=0)
        starts = torch.tensor([0, *lens]).cumsum(0)
        slots = torch.arange(longest)[None, :] + starts[:-1, None]  # [S, longest]
        slots = torch.where(torch.arange(longest)[None, :] < torch.tensor(lens)[:, None], slots, -1)
        own = starts[-1] + torch.arange(rows).view(len(context), size)  # [S, B]
        slots = torch.cat((slots, own), dim=1).repeat_interleave(size, dim=0)  # [S * B, K]
        out = v4_ops.sink_attention(
            q, keys[:, None, None, None, :], slots.to(q.device), None, None, self.attn_sink,
            d**-0.5,
        )  # fmt: skip
        out = Rope.apply(out, cos_sin[0], -cos_sin[1])  # the values' rotation undone
        grouped = out.reshape(rows, self.groups, -1).transpose(0, 1)  # [g, S * B, in]
        w = self.wo_a.weight.view(self.groups, -1, grouped.shape[-1]).transpose(1, 2)
        return self.wo_b(torch.bmm(grouped, w).transpose(0, 1).reshape(rows, -1))


class DraftMoE(nn.Module):
    """A stage's experts: sqrtsoftplus top-k over ``scores + bias`` (never hashed)."""

    def __init__(self, target: ModelConfig, v4: V4Config) -> None:
        super().__init__()
        hidden, inter = target.hidden_size, v4.moe_intermediate_size
        self.gate = Gate(v4, hidden, target.vocab_size, is_hash=False)
        self.experts = nn.ModuleList(
            Expert(hidden, inter, v4.swiglu_limit) for _ in range(v4.num_experts)
        )
        self.shared_experts = Expert(hidden, inter, v4.swiglu_limit)

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x, input_ids)
        out = torch.zeros_like(x)
        for e in ids.unique().tolist():
            token, slot = torch.where(ids == e)
            out.index_add_(0, token, (self.experts[e](x[token]) * weights[token, slot, None]))
        return out + self.shared_experts(x)


class MarkovHead(nn.Module):
    def __init__(self, vocab: int, rank: int) -> None:
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab, rank)
        self.markov_w2 = nn.Linear(rank, vocab, bias=False)


class ConfidenceHead(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.proj = nn.Linear(width, 1, bias=False)


class DraftStage(nn.Module):
    """``mtp.N``: a V4 block (hyper-connections around attention and experts); the first
    also projects the target's features (``main_proj``, ``main_norm``), the last also holds
    the streams' collapse, the final norm and the Markov and confidence heads."""

    def __init__(self, target: ModelConfig, v4: V4Config, cfg: V4DSparkConfig, stage: int) -> None:
        super().__init__()
        n, hidden, eps = v4.hc_mult, target.hidden_size, target.rms_norm_eps
        self.v4, self.eps = v4, eps
        self.attn_norm = RMSNorm(hidden, eps)
        self.attn = DraftAttention(target, v4)
        self.ffn_norm = RMSNorm(hidden, eps)
        self.ffn = DraftMoE(target, v4)
        for part in ("attn", "ffn"):
            setattr(self, f"hc_{part}_fn", nn.Parameter(torch.zeros((2 + n) * n, n * hidden)))
            setattr(self, f"hc_{part}_base", nn.Parameter(torch.zeros((2 + n) * n)))
            setattr(self, f"hc_{part}_scale", nn.Parameter(torch.ones(3)))
        if stage == 0:
            self.main_proj = nn.Linear(len(cfg.target_layer_ids) * hidden, hidden, bias=False)
            self.main_norm = RMSNorm(hidden, eps)
        if stage == cfg.num_stages - 1:
            self.norm = RMSNorm(hidden, eps)
            self.hc_head_fn = nn.Parameter(torch.zeros(n, n * hidden))
            self.hc_head_base = nn.Parameter(torch.zeros(n))
            self.hc_head_scale = nn.Parameter(torch.ones(1))
            self.markov_head = MarkovHead(target.vocab_size, cfg.markov_rank)
            self.confidence_head = ConfidenceHead(hidden + cfg.markov_rank)

    def _mix(self, part: str, streams: torch.Tensor) -> tuple[torch.Tensor, ...]:
        fn, base, scale = (getattr(self, f"hc_{part}_{k}") for k in ("fn", "base", "scale"))
        return hyper_weights(streams, fn, base, scale, self.v4, self.eps)

    def forward(
        self,
        streams: torch.Tensor,  # [R, n, hidden]
        input_ids: torch.Tensor,  # [R]
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        context: list[torch.Tensor],
    ) -> torch.Tensor:  # [R, n, hidden]
        dtype = streams.dtype
        post, comb, collapsed = self._mix("attn", streams)
        out = self.attn(self.attn_norm(collapsed), cos_sin, context)
        streams = post.to(dtype)[..., None] * out[:, None, :] + torch.matmul(
            comb.to(dtype).transpose(-1, -2), streams
        )
        post, comb, collapsed = self._mix("ffn", streams)
        out = self.ffn(self.ffn_norm(collapsed), input_ids)
        return post.to(dtype)[..., None] * out[:, None, :] + torch.matmul(
            comb.to(dtype).transpose(-1, -2), streams
        )

    def collapse(self, streams: torch.Tensor) -> torch.Tensor:  # [R, n, hidden] -> [R, hidden]
        """``hc_head``: a sigmoid weight per stream (no Sinkhorn), as the target's head."""
        mixes = F.linear(rms(streams.flatten(1).float(), self.eps), self.hc_head_fn.float())
        pre = torch.sigmoid(mixes * self.hc_head_scale.float() + self.hc_head_base.float())
        return ((pre + self.v4.hc_eps)[..., None] * streams).sum(dim=1).to(streams.dtype)


class V4DSparkDraft(nn.Module):
    """The proposer's view (common/engine/spec_decode/dspark_v4.py): ``context_rows``,
    ``block``, ``prev_embed``, ``row_logits``, ``confidence``."""

    def __init__(
        self, cfg: V4DSparkConfig, target: ModelConfig, embed: nn.Embedding, head: nn.Linear
    ) -> None:
        super().__init__()
        v4 = target.v4
        assert v4 is not None
        v4 = msgspec.structs.replace(v4, num_experts=cfg.num_experts, top_k=cfg.top_k)
        self.cfg, self.hc_mult = cfg, v4.hc_mult
        self.mtp = nn.ModuleList(DraftStage(target, v4, cfg, i) for i in range(cfg.num_stages))
        # the stages' attention is sliding-only: the main rope, without yarn
        self.rope = Rope(v4.rope_dim, target.rope_theta, None)
        self.shared = (embed, head)  # the target's: a tuple, so not this module's parameters

    @property
    def first(self) -> DraftStage:
        return cast(DraftStage, self.mtp[0])

    @property
    def last(self) -> DraftStage:
        return cast(DraftStage, self.mtp[-1])

    def _cos_sin(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self.rope.cos_sin(positions)
        return cos.to(dtype), sin.to(dtype)

    def context_rows(self, features: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """[stages, T, D]: each stage's context rows of positions ``positions`` [T] from the
        target's features there [T, L * hidden]."""
        main_x = self.first.main_norm(self.first.main_proj(features))  # [T, hidden]
        cs = self._cos_sin(positions, main_x.dtype)
        return torch.stack([cast(DraftStage, s).attn.rows(main_x, cs) for s in self.mtp])

    def block(
        self,
        anchors: torch.Tensor,  # [S]: each sequence's last token t_s
        positions: torch.Tensor,  # [S]: its position s
        context: list[list[torch.Tensor]],  # [stage][seq]: context rows [n, D]
    ) -> torch.Tensor:  # [S, B, hidden]: each block row, streams collapsed, before the norm
        num, size = anchors.shape[0], self.cfg.block_size
        ids = torch.full((num, size), self.cfg.mask_token_id, dtype=torch.long,
                         device=anchors.device)  # fmt: skip
        ids[:, 0] = anchors
        ids = ids.view(-1)
        x = self.shared[0](ids)  # [S * B, hidden]
        streams = x[:, None, :].expand(-1, self.hc_mult, -1).contiguous()
        pos = (positions[:, None] + torch.arange(size, device=anchors.device)).view(-1)
        cs = self._cos_sin(pos, x.dtype)
        for stage, ctx in zip(self.mtp, context, strict=True):
            streams = stage(streams, ids, cs, ctx)
        return self.last.collapse(streams).view(num, size, -1)

    def prev_embed(self, prev: torch.Tensor) -> torch.Tensor:  # [S] -> [S, r]
        return cast(torch.Tensor, self.last.markov_head.markov_w1(prev))

    def row_logits(
        self, h: torch.Tensor, embed: torch.Tensor | None, state: None
    ) -> tuple[torch.Tensor, None]:  # ([S, V] float32, no Markov state)
        assert embed is not None
        logits = self.shared[1](self.last.norm(h)) + self.last.markov_head.markov_w2(embed)
        return logits.float(), None

    def confidence(self, h: torch.Tensor, embed: torch.Tensor | None) -> torch.Tensor:
        """[S] logits of row i's survival (in float32, as the reference keeps the head)."""
        assert embed is not None
        w = self.last.confidence_head.proj.weight.float()
        return F.linear(torch.cat([h, embed.to(h.dtype)], -1).float(), w).squeeze(-1)


def read_config(path: Path, target: ModelConfig, keys: list[str]) -> V4DSparkConfig:
    """The DSpark fields of ``path``'s config.json, the stages from the tensor names
    ``keys``; a ModelLoadError naming what is missing."""
    try:
        raw: dict[str, Any] = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"DSpark: cannot read {path / 'config.json'}: {exc}") from exc
    stages = sorted({int(m[1]) for k in keys if (m := _STAGE.match(k))})
    missing = [k for k in KEYS if k not in raw]
    if missing:
        has = (
            " (its mtp.* tensors are a NextN MTP layer: e_proj, h_proj)"
            if any(k.startswith("mtp.0.e_proj") for k in keys)
            else ""
        )
        raise ModelLoadError(
            f"speculative method 'dspark': {path} has no DSpark module: config.json lacks "
            f"{', '.join(missing)}{has}; DeepSeek-V4 checkpoints with DSpark (V4-Flash-DSpark, "
            "V4-Flash-0731) carry these keys and the mtp.0 .. mtp.N draft stages"
        )
    if not stages or stages != list(range(len(stages))):
        raise ModelLoadError(
            f"speculative method 'dspark': {path} config.json names a DSpark module but its "
            f"safetensors hold no mtp.0 .. mtp.N stages (found {stages})"
        )
    v4 = target.v4
    assert v4 is not None
    return V4DSparkConfig(
        block_size=int(raw["dspark_block_size"]),
        mask_token_id=int(raw["dspark_noise_token_id"]),
        target_layer_ids=tuple(int(i) for i in raw["dspark_target_layer_ids"]),
        markov_rank=int(raw.get("dspark_markov_rank", 256)),
        num_stages=len(stages),
        window=target.sliding_window or 128,
        num_experts=int(raw.get("dspark_n_routed_experts", v4.num_experts)),
        top_k=int(raw.get("dspark_num_experts_per_tok", v4.top_k)),
    )


def load_v4_dspark(
    path: Path,
    target: ModelConfig,
    embed: nn.Embedding,
    head: nn.Linear,
    dtype: torch.dtype,
    device: torch.device,
) -> V4DSparkDraft:
    """The draft of the DeepSeek-V4 checkpoint at ``path`` (its ``mtp.*`` tensors)."""
    from safetensors import safe_open

    files = sorted(path.glob("*.safetensors"))
    state: dict[str, torch.Tensor] = {}
    for f in files:
        with safe_open(str(f), "pt", device="cpu") as h:
            state.update({k: h.get_tensor(k) for k in h.keys() if k.startswith("mtp.")})  # noqa: SIM118
    cfg = read_config(path, target, list(state))
    quantized = sorted(k for k in state if k.endswith(".scale") and "hc_" not in k)
    if quantized:
        raise ModelLoadError(
            f"speculative method 'dspark': {path} holds quantized DSpark weights (fp8 / fp4 "
            f"with block scales, e.g. {quantized[0]}), which pdserve does not read yet; "
            "dequantize the checkpoint to bf16 first"
        )
    with torch.device("meta"):
        draft = V4DSparkDraft(cfg, target, embed, head)
    want = set(draft.state_dict())
    missing, unexpected = sorted(want - set(state)), sorted(set(state) - want)
    if missing or unexpected:
        raise ModelLoadError(
            f"speculative method 'dspark': the DSpark tensors of {path} do not match its "
            f"config: missing {missing[:5]}, unexpected {unexpected[:5]}"
        )
    shapes = draft.state_dict()
    wrong = [f"{k} {list(v.shape)} (want {list(shapes[k].shape)})"
             for k, v in state.items() if v.shape != shapes[k].shape]  # fmt: skip
    if wrong:
        raise ModelLoadError(
            f"speculative method 'dspark': the DSpark tensors of {path} do not fit this "
            f"target: {'; '.join(wrong[:3])}"
        )
    draft.load_state_dict(state, assign=True)
    return draft.to(device=device, dtype=dtype).eval().requires_grad_(False)
