"""DeepSeek-V4's model: hyper-connected residual streams around V4 attention
(common/model/deepseek/dsv4_attention.py) and its mixtures of experts; the CPU reference.

Parameter names are the checkpoint's: ``model.embed_tokens``, ``model.layers.N.{attn_norm,
attn, ffn_norm, ffn, hc_attn_*, hc_ffn_*}``, ``model.norm``, ``model.hc_head``, ``head``.

* Hyper-connections: the residual is ``hc_mult`` streams [T, n, hidden]. Before a block,
  ``hc_*_fn`` of the normed, flattened streams gives per token ``pre`` (sigmoid: the
  streams' weights into the block's input), ``post`` (2 sigmoid: the block output's weight
  into each stream) and ``comb`` (softmax, then Sinkhorn-Knopp towards a doubly stochastic
  matrix: how the streams mix); after it the streams are ``post * out + comb^T @ streams``.
  ``hc_head`` collapses them before the final norm.
* Experts: SiLU-gated with the gate clamped above and the up projection on both sides at
  ``swiglu_limit`` (the shared expert too); scores ``sqrt(softplus(logits))``; a ``moe``
  layer picks the top-k of ``scores + bias``, a ``hash_moe`` layer the experts
  ``tid2eid[token id]``; the chosen scores renormalised, times ``routed_scaling_factor``.

The engine drives it as it drives ``CausalLM`` (common/model/decoder.py): the same
``forward`` over a flat batch and paged cache, on CPU (a PCP rank too: its attention
gathers every rank's new rows). Under TP a rank holds its heads and output groups, its
experts and a slice of the shared expert (common/model/deepseek/dsv4_tp.py); attention and the
experts each end in one all-reduce.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from torch.nn import functional as F

from pdserve.common.model.checkpoint.config import ModelConfig
from pdserve.common.model.checkpoint.moe_config import local_experts
from pdserve.common.model.deepseek.dsv4_attention import RMSNorm, Rope, V4Attention, V4Step
from pdserve.common.model.deepseek.dsv4_config import HASH_MOE, SLIDING, V4Config
from pdserve.common.model.layers.attention import AttentionMetadata
from pdserve.common.model.layers.linear import pack_linears
from pdserve.common.parallel.context import ParallelContext


class HyperHead(nn.Module):
    """The streams collapsed into one before the final norm (``model.hc_head``)."""

    def __init__(self, v4: V4Config, hidden: int, eps: float) -> None:
        super().__init__()
        n = v4.hc_mult
        self.hc_fn = nn.Parameter(torch.zeros(n, n * hidden))
        self.hc_base = nn.Parameter(torch.zeros(n))
        self.hc_scale = nn.Parameter(torch.ones(1))
        self.eps, self.hc_eps = eps, v4.hc_eps

    def forward(self, streams: torch.Tensor) -> torch.Tensor:  # [T, n, hidden] -> [T, hidden]
        from pdserve import kernels  # on CUDA one kernel (kernels/triton_hyper.py)

        return kernels.hyper_collapse(
            streams, self.hc_fn, self.hc_base, self.hc_scale, self.eps, self.hc_eps
        )


def hyper_weights(
    streams: torch.Tensor,  # [T, n, hidden]
    fn: torch.Tensor,  # [(2 + n) * n, n * hidden]
    base: torch.Tensor,  # [(2 + n) * n]
    scale: torch.Tensor,  # [3]
    v4: V4Config,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # post [T, n], comb [T, n, n], input
    """transformers' DeepseekV4HyperConnection: op for op on CPU (kernels/hyper_ref.py), one
    Triton kernel on CUDA (kernels/triton_hyper.py) instead of ~100 launches."""
    from pdserve import kernels

    return kernels.hyper_mix(streams, fn, base, scale, eps, v4.hc_eps, v4.hc_sinkhorn_iters)


# a block's (post [T, n] fp32, comb [T, n, n] fp32, output [T, hidden]) not yet added back
# into the streams (the fused glue: V4Layer.forward)
Pending = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def fused_glue(streams: torch.Tensor) -> bool:
    """Whether V4's layer glue runs fused (kernels/triton_hyper.py ``step``): on the Triton
    backend (CUDA) with a power-of-two ``hc_mult``; else the reference's ops."""
    from pdserve import kernels

    n = streams.shape[1]
    return kernels.backend_name(streams.device) == "triton" and n & (n - 1) == 0


class Expert(nn.Module):
    def __init__(self, hidden: int, inter: int, limit: float) -> None:
        super().__init__()
        self.w1 = nn.Linear(hidden, inter, bias=False)  # gate
        self.w2 = nn.Linear(inter, hidden, bias=False)  # down
        self.w3 = nn.Linear(hidden, inter, bias=False)  # up
        self.limit = limit
        self.gate_up: torch.Tensor | None = None  # pack(): w1's rows then w3's

    def pack(self) -> None:
        """w1 and w3 as one [2I, H] matrix (w1, w3 views into it): one GEMM and one
        ``kernels.silu_and_mul`` with the limit instead of two GEMMs and four pointwise
        ops (the shared expert on CUDA: V4CausalLM.pack_weights)."""
        self.gate_up = pack_linears([self.w1, self.w3])[0]

    def packed(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(gate_up [2I, H], down [H, I]) while ``pack``'s stack still holds w1 and w3 (a
        load that replaced them unpacks the expert)."""
        packed = self.gate_up
        if packed is not None and self.w1.weight.data_ptr() == packed.data_ptr():
            return packed, self.w2.weight
        return None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        packed = self.gate_up
        if packed is not None and self.w1.weight.data_ptr() == packed.data_ptr():
            from pdserve import kernels

            return self.w2(kernels.silu_and_mul(F.linear(x, packed), self.limit))
        gate = self.w1(x).clamp(max=self.limit)
        up = self.w3(x).clamp(min=-self.limit, max=self.limit)
        return self.w2(F.silu(gate) * up)


class Gate(nn.Module):
    tid2eid: torch.Tensor  # [vocab, top_k] int64, a buffer (hash_moe layers)

    def __init__(self, v4: V4Config, hidden: int, vocab: int, is_hash: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(v4.num_experts, hidden))
        self.is_hash, self.top_k, self.factor = is_hash, v4.top_k, v4.routed_scaling_factor
        if is_hash:  # the frozen token-id -> experts table
            self.register_buffer("tid2eid", torch.zeros(vocab, v4.top_k, dtype=torch.long))
        else:  # e_score_correction_bias: steers the choice, not the weights
            self.bias = nn.Parameter(torch.zeros(v4.num_experts))

    def forward(
        self, x: torch.Tensor, input_ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:  # (weights [T, k], expert ids [T, k])
        from pdserve import kernels

        logits = F.linear(x, self.weight)
        routed = kernels.moe_route(  # on CUDA one kernel (kernels/triton_route.py)
            logits, self.top_k, True, "sqrtsoftplus", None if self.is_hash else self.bias,
            scale=self.factor, hash_ids=self.tid2eid if self.is_hash else None,
            token_ids=input_ids if self.is_hash else None,  # the table read in the kernel
        )  # fmt: skip
        if routed is not None:  # float32 weights: the experts' kernels weigh in float32
            return routed
        hashed = self.tid2eid[input_ids].long() if self.is_hash else None
        scores = F.softplus(logits).sqrt()
        if hashed is not None:
            ids = hashed
        else:
            ids = torch.topk(scores + self.bias, self.top_k, dim=-1, sorted=False).indices
        weights = scores.gather(1, ids)
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.factor, ids


class V4MoE(nn.Module):
    """Routed experts (top-k by score, or ``tid2eid`` of the token id in a hash layer) plus
    the shared expert. The routed experts run as one op over this rank's experts stacked
    (``kernels.moe_experts``: on CUDA tokens sorted by expert and one grouped GEMM per
    projection, or at decode sizes the two decode kernels, no host sync, CUDA-graph
    capturable; on CPU the reference loop), the clamped SwiGLU at ``swiglu_limit``. On the
    Triton backend the shared expert is packed (w1/w3 one GEMM) and handed to the same call,
    which folds it into the decode kernels as one more slot (#47)."""

    def __init__(self, cfg: ModelConfig, v4: V4Config, layer: int, par: ParallelContext) -> None:
        super().__init__()
        self.par = par
        hidden, inter = cfg.hidden_size, v4.moe_intermediate_size
        self.gate = Gate(v4, hidden, cfg.vocab_size, v4.mlp_kinds[layer] == HASH_MOE)
        # this rank's experts, under the checkpoint's indices (experts.N.*)
        self.first, self.count = local_experts(v4.num_experts, par.tp_size, par.tp_rank)
        self.experts = nn.ModuleDict(
            {
                str(e): Expert(hidden, inter, v4.swiglu_limit)
                for e in range(self.first, self.first + self.count)
            }
        )
        self.shared_experts = Expert(hidden, inter // par.tp_size, v4.swiglu_limit)
        self.limit = v4.swiglu_limit
        self._stacked: tuple[torch.Tensor, torch.Tensor] | None = None
        # [E] bool, set by common/model/layers/moe.py record_expert_usage (benchmarks)
        self.touched: torch.Tensor | None = None

    def stacked_experts(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's experts as ``gate_up`` [E, 2I, H] (w1's rows, then w3's) and ``down``
        [E, H, I] (w2). Stacked once (the first forward, before any CUDA-graph capture);
        each expert's weights are then views into the stacks, so the experts are held
        once. Stacked again if its weights were replaced since (a load, a move)."""
        experts: list[Expert] = []
        for e in range(self.first, self.first + self.count):
            m = self.experts[str(e)]
            assert isinstance(m, Expert)
            experts.append(m)
        if self._stacked is not None:
            if experts[0].w1.weight.data_ptr() == self._stacked[0].data_ptr():
                return self._stacked
        with torch.no_grad():
            w = [(m.w1.weight, m.w3.weight, m.w2.weight) for m in experts]
            inter = w[0][0].shape[0]
            gate_up = w[0][0].new_empty((len(w), 2 * inter, w[0][0].shape[1]))
            down = w[0][2].new_empty((len(w), *w[0][2].shape))
            for i, (m, (w1, w3, w2)) in enumerate(zip(experts, w, strict=True)):
                gate_up[i, :inter].copy_(w1)
                gate_up[i, inter:].copy_(w3)
                down[i].copy_(w2)
                # the expert's own tensors give way to views (freed as we go)
                m.w1.weight.data = gate_up[i, :inter]
                m.w3.weight.data = gate_up[i, inter:]
                m.w2.weight.data = down[i]
            del w
        self._stacked = (gate_up, down)
        return self._stacked

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        from pdserve import kernels

        weights, ids = self.gate(x, input_ids)
        if self.touched is not None:  # a device op: CUDA graphs capture it too
            self.touched.index_fill_(0, ids.flatten(), True)
        gate_up, down = self.stacked_experts()
        shared = self.shared_experts
        if kernels.backend_name(x.device) == "triton":
            if shared.packed() is None:  # packed once (first forward: before any capture)
                shared.pack()
            out = kernels.moe_experts(
                x, ids, weights, gate_up, down, self.first, self.limit, shared=shared.packed()
            )
        else:  # the reference: transformers' ops
            out = kernels.moe_experts(x, ids, weights, gate_up, down, self.first, self.limit)
            out = out + shared(x)
        return self.par.all_reduce_tp(out)


class V4Layer(nn.Module):
    def __init__(self, cfg: ModelConfig, v4: V4Config, layer: int, par: ParallelContext) -> None:
        super().__init__()
        n, hidden = v4.hc_mult, cfg.hidden_size
        self.v4, self.eps = v4, cfg.rms_norm_eps
        self.attn_norm = RMSNorm(hidden, cfg.rms_norm_eps)
        self.attn = V4Attention(cfg, layer, par)
        self.ffn_norm = RMSNorm(hidden, cfg.rms_norm_eps)
        self.ffn = V4MoE(cfg, v4, layer, par)
        for part in ("attn", "ffn"):
            setattr(self, f"hc_{part}_fn", nn.Parameter(torch.zeros((2 + n) * n, n * hidden)))
            setattr(self, f"hc_{part}_base", nn.Parameter(torch.zeros((2 + n) * n)))
            setattr(self, f"hc_{part}_scale", nn.Parameter(torch.ones(3)))

    def _mix(self, part: str, streams: torch.Tensor) -> tuple[torch.Tensor, ...]:
        fn, base, scale = (getattr(self, f"hc_{part}_{k}") for k in ("fn", "base", "scale"))
        return hyper_weights(streams, fn, base, scale, self.v4, self.eps)

    def _glue(
        self, part: str, streams: torch.Tensor, prev: Pending | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """One launch, two below 128 tokens (kernels/triton_hyper.py ``step``): the previous
        block's output added back (``prev``), this block's mix, its norm. (streams, post,
        comb, normed input)."""
        from pdserve.kernels import triton_hyper

        fn, base, scale = (getattr(self, f"hc_{part}_{k}") for k in ("fn", "base", "scale"))
        norm = self.attn_norm if part == "attn" else self.ffn_norm
        new, post, comb, x = triton_hyper.step(
            streams, fn, base, scale, self.eps, self.v4.hc_eps, self.v4.hc_sinkhorn_iters,
            prev=prev, norm=(norm.weight, norm.eps),
        )  # fmt: skip
        return (streams if new is None else new), post, comb, x

    def forward(
        self,
        streams: torch.Tensor,  # [T, n, hidden]: before ``pending`` is added back
        input_ids: torch.Tensor,  # [T]
        rope: Rope,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        caches: tuple[
            torch.Tensor, AttentionMetadata, torch.Tensor | None, AttentionMetadata | None
        ],
        step: V4Step,
        pending: Pending | None = None,  # fused: the previous layer's ffn, not yet added
    ) -> tuple[torch.Tensor, Pending | None]:  # (streams [T, n, hidden], pending)
        """The reference (transformers' ops): the streams after the layer, pending None.
        Fused (``fused_glue``: the Triton backend), each block's input comes out of one
        kernel (kernels/triton_hyper.py ``step``; two at decode sizes) that first adds the
        previous block's output back into the streams, then mixes and norms; this layer's
        own ffn output is left pending, (post, comb, out), for the next layer's first
        kernel (or the head's) to add; ``hyper_ref.combine`` adds it where it is needed."""
        if pending is not None or fused_glue(streams):
            streams, post, comb, x = self._glue("attn", streams, pending)
            out = self.attn(x, rope, cos_sin, *caches, step=step)
            streams, post, comb, x = self._glue("ffn", streams, (post, comb, out))
            return streams, (post, comb, self.ffn(x, input_ids))
        dtype = streams.dtype
        post, comb, collapsed = self._mix("attn", streams)
        out = self.attn(self.attn_norm(collapsed), rope, cos_sin, *caches, step=step)
        streams = post.to(dtype)[..., None] * out[:, None, :] + torch.matmul(
            comb.to(dtype).transpose(-1, -2), streams
        )
        post, comb, collapsed = self._mix("ffn", streams)
        out = self.ffn(self.ffn_norm(collapsed), input_ids)
        streams = post.to(dtype)[..., None] * out[:, None, :] + torch.matmul(
            comb.to(dtype).transpose(-1, -2), streams
        )
        return streams, None


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig, v4: V4Config, par: ParallelContext) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(V4Layer(cfg, v4, i, par) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hc_head = HyperHead(v4, cfg.hidden_size, cfg.rms_norm_eps)


class DeepseekV4Model(nn.Module):
    """``CausalLM``'s interface (common/model/decoder.py) over V4's stack."""

    def __init__(self, cfg: ModelConfig, sliding_window: int, par: ParallelContext) -> None:
        super().__init__()
        v4 = cfg.v4
        assert v4 is not None
        self.config = cfg
        self.model = Backbone(cfg, v4, par)
        self.head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        for layer in self.model.layers:
            assert isinstance(layer, V4Layer)
            layer.attn.window = sliding_window
        self.ropes = {
            "main": Rope(v4.rope_dim, cfg.rope_theta, None),
            "compress": Rope(v4.rope_dim, v4.compress_rope_theta, v4.compress_rope_scaling),
        }
        # Each layer's (group, slot) of its per-token rows and, compressed, of its entries:
        # the engine's cache groups, handed over by the loader (place_kv).
        self.kv_slots = [(0, i) for i in range(cfg.num_hidden_layers)]
        self.rows_slots: list[tuple[int, int]] = [(0, i) for i in range(cfg.num_hidden_layers)]
        self.entries_slots: list[tuple[int, int] | None] = [None] * cfg.num_hidden_layers
        # DSpark (common/engine/spec_decode/dspark_v4.py): with keep_hidden and hidden_layers,
        # a forward leaves each token's streams after those layers, averaged over the
        # hyper-connection streams, side by side (the official reference's main_hidden)
        self.keep_hidden = False
        self.hidden_layers: tuple[int, ...] | None = None
        self.hidden: torch.Tensor | None = None  # [S, L * hidden]: the logits rows'
        self.hidden_rows: torch.Tensor | None = None  # [T, L * hidden]: every token's
        # common/engine/model_runner.py captures no decode graph of a model that says why.
        # None: a decode step is device work of static shapes throughout (dsv4_attention's
        # V4Step; V4MoE's routing and grouped experts read no host value)
        self.cuda_graphs_refused: str | None = None

    def place_kv(self, groups: Sequence[tuple[Sequence[int], int]]) -> None:
        """Each layer's slot of its per-token rows (groups of 1 token a slot) and of its
        compressed entries (groups of ``rate`` tokens a slot), from the engine's cache
        groups in order (common/engine/kv_groups.py cache_groups)."""
        for g, (layers, rate) in enumerate(groups):
            for j, layer_id in enumerate(layers):
                self.kv_slots[layer_id] = (g, j)  # as every model's (not read here)
                if rate == 1:
                    self.rows_slots[layer_id] = (g, j)
                else:
                    self.entries_slots[layer_id] = (g, j)

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_cache: torch.Tensor,  # [N, L, 1, 1, B, row]
        meta: AttentionMetadata,
        logits_indices: torch.Tensor,  # [S]
    ) -> torch.Tensor:  # [S, vocab] float32
        from pdserve import kernels

        v4 = self.config.v4
        assert v4 is not None
        x = self.model.embed_tokens(input_ids)
        streams = x[:, None, :].expand(-1, v4.hc_mult, -1).contiguous()
        cos_sin: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        for name, rope in self.ropes.items():  # in the model's dtype once, not once a layer
            cos, sin = rope.cos_sin(positions)
            cos_sin[name] = (cos.to(x.dtype), sin.to(x.dtype))
        taps = self.hidden_layers if self.keep_hidden else None
        kept: list[torch.Tensor] = []
        step = V4Step(meta, positions)  # every layer's index metadata, built once
        pending: Pending | None = None  # fused: the last ffn's output, not yet added back
        for i, layer in enumerate(self.model.layers):
            assert isinstance(layer, V4Layer)
            name = "main" if layer.attn.kind == SLIDING else "compress"
            group, slot = self.rows_slots[i]
            entries = self.entries_slots[i]
            caches = (
                kv_cache[:, slot],
                meta.of_group(group),
                None if entries is None else kv_cache[:, entries[1]],
                None if entries is None else meta.of_group(entries[0]),
            )
            streams, pending = layer(
                streams, input_ids, self.ropes[name], cos_sin[name], caches, step, pending
            )
            if taps and i in taps:  # a layer's output, not its input (V4-Flash's DSpark)
                if pending is not None:
                    streams, pending = kernels.hyper_ref.combine(streams, *pending), None
                kept.append(streams.mean(dim=1))
        if kept:
            self.hidden_rows = torch.cat(kept, dim=-1)
            self.hidden = self.hidden_rows[logits_indices]
        if fused_glue(streams):  # the last combine, hc_head, the final norm: one launch
            from pdserve.kernels import triton_hyper

            hh, norm = self.model.hc_head, self.model.norm
            h = triton_hyper.step(
                streams, hh.hc_fn, hh.hc_base, hh.hc_scale, hh.eps, hh.hc_eps, 0,
                prev=pending, norm=(norm.weight, norm.eps), head=True, rows=logits_indices,
                store=False,
            )[3]  # fmt: skip
        else:
            h = self.model.norm(self.model.hc_head(streams[logits_indices]))
        return self.head(h).float()

    def decode_splits(self, num_seqs: int, num_kv_heads: int, device: torch.device) -> int:
        return 1

    def pack_weights(self, prepack: bool = False) -> None:
        """On CUDA (``prepack`` False: the loader's call there) the shared experts' w1/w3
        as one GEMM (``Expert.pack``) and each attention's linears of x as one
        (``V4Attention.pack``); on CPU nothing packs: the reference runs each
        projection as it is stored."""
        if prepack:
            return
        for m in self.modules():
            if isinstance(m, V4MoE):
                m.shared_experts.pack()
            elif isinstance(m, V4Attention):  # the linears of x as one GEMM
                m.pack()
