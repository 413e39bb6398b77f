"""The sparse MLP of a mixture-of-experts layer: router, routed experts, shared experts.

Parameter names are those of transformers' ``Qwen3MoeSparseMoeBlock`` / ``DeepseekV3MoE``
(``gate.weight``, ``gate.e_score_correction_bias``, ``experts.gate_up_proj`` [E, 2I, H],
``experts.down_proj`` [E, H, I], ``shared_experts.{gate,up,down}_proj.weight``);
:func:`fuse_expert_weights` turns the per-expert tensors that ``save_pretrained`` writes
(``experts.{e}.gate_proj.weight`` ...) into the 3-D ones, keeping only this rank's experts.

Expert parallelism over the TP group: rank r of N holds whole experts
``[r * E / N, (r + 1) * E / N)`` (common/model/checkpoint/moe_config.py: ``local_experts``); attention stays
tensor-parallel. TP attention ends in an all-reduce, so every rank already holds every
token's hidden state: that all-reduce is the all-gather half of the all-gather /
reduce-scatter exchange. Each rank routes all tokens (the router is replicated, so every
rank picks the same experts), computes its own experts for the tokens routed to them
(and its TP slice of the shared experts), and one all-reduce (the reduce-scatter of the
partial sums plus the all-gather that the next TP attention needs) returns the sums.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

from pdserve import kernels
from pdserve.common.errors import ModelLoadError
from pdserve.common.model.checkpoint.moe_config import SIGMOID, MoEConfig, local_experts
from pdserve.common.model.layers.linear import Linear, pack_linears
from pdserve.common.parallel.context import ParallelContext


def route(
    logits: torch.Tensor,  # [T, E] router logits
    moe: MoEConfig,
    correction_bias: torch.Tensor | None = None,  # [E] DeepSeek's e_score_correction_bias
) -> tuple[torch.Tensor, torch.Tensor]:  # (weights [T, k], expert ids [T, k] int64)
    """The experts each token goes to and their weights, as transformers computes them
    (on CUDA one Triton kernel, ``kernels.moe_route``; the same choice, the k in another
    order, the weights left in float32: the experts' kernels weigh in float32 anyway, and a
    cast would be one more launch a layer)."""
    sigmoid = moe.scoring == SIGMOID
    scale = moe.routed_scaling_factor if sigmoid else 1.0
    routed = kernels.moe_route(
        logits, moe.top_k, moe.norm_topk_prob, moe.scoring, correction_bias, moe.n_group,
        moe.topk_group, scale,
    )  # fmt: skip
    if routed is not None:
        return routed
    if moe.scoring == SIGMOID:
        return _route_grouped_sigmoid(logits.float(), moe, correction_bias)
    probs = F.softmax(logits, dim=-1, dtype=torch.float)
    weights, ids = torch.topk(probs, moe.top_k, dim=-1)
    if moe.norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(logits.dtype), ids


def _route_grouped_sigmoid(
    logits: torch.Tensor, moe: MoEConfig, bias: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3: sigmoid scores; experts chosen on the bias-corrected scores within the
    ``topk_group`` groups whose two best corrected scores sum highest; weighted by the
    uncorrected scores (renormalised when norm_topk_prob), times routed_scaling_factor."""
    num_tokens, num_experts = logits.shape
    per_group = num_experts // moe.n_group
    scores = logits.sigmoid()
    choice = scores if bias is None else scores + bias.float()
    grouped = choice.view(num_tokens, moe.n_group, per_group)
    group_scores = grouped.topk(min(2, per_group), dim=-1)[0].sum(dim=-1)  # [T, G]
    groups = torch.topk(group_scores, k=moe.topk_group, dim=-1, sorted=False)[1]
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, groups, True)
    keep = keep.unsqueeze(-1).expand(-1, -1, per_group).reshape(num_tokens, num_experts)
    ids = torch.topk(choice.masked_fill(~keep, float("-inf")), moe.top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, ids)
    if moe.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * moe.routed_scaling_factor, ids


class Router(nn.Module):
    def __init__(self, hidden_size: int, moe: MoEConfig) -> None:
        super().__init__()
        self.moe = moe
        self.weight = nn.Parameter(torch.zeros(moe.num_experts, hidden_size))
        self.e_score_correction_bias: torch.Tensor | None
        if moe.scoring == SIGMOID:
            self.register_buffer("e_score_correction_bias", torch.zeros(moe.num_experts))
        else:
            self.e_score_correction_bias = None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.moe.scoring == SIGMOID:  # DeepSeek routes in float32 whatever the model dtype
            logits = F.linear(x.float(), self.weight.float())
        else:
            logits = F.linear(x, self.weight)
        return route(logits, self.moe, self.e_score_correction_bias)


class Experts(nn.Module):
    """This rank's routed experts, as 3-D tensors."""

    def __init__(self, hidden_size: int, moe: MoEConfig, par: ParallelContext) -> None:
        super().__init__()
        self.first, count = local_experts(moe.num_experts, par.tp_size, par.tp_rank)
        size = moe.intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(count, 2 * size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(count, hidden_size, size))

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return kernels.moe_experts(x, ids, weights, self.gate_up_proj, self.down_proj, self.first)


class SharedExperts(nn.Module):
    """DeepSeek's shared experts: one dense gated MLP, its intermediate split over TP.
    Packed (:meth:`pack`, as ``MLP.pack``): gate/up one GEMM and ``kernels.silu_and_mul``,
    three launches instead of five."""

    def __init__(self, hidden_size: int, size: int, tp_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, size // tp_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, size // tp_size, bias=False)
        self.down_proj = nn.Linear(size // tp_size, hidden_size, bias=False)
        self.gate_up: Linear | None = None
        self.down: Linear | None = None

    def pack(self, prepack: bool = False) -> None:
        self.gate_up = Linear(*pack_linears([self.gate_proj, self.up_proj]), prepack)
        self.down = Linear(self.down_proj.weight, None, prepack)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # this rank's partial sum
        if self.gate_up is not None and self.down is not None:
            return self.down(kernels.silu_and_mul(self.gate_up(x)))
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class SparseMoeBlock(nn.Module):
    def __init__(self, hidden_size: int, moe: MoEConfig, par: ParallelContext) -> None:
        super().__init__()
        self.par = par
        self.gate = Router(hidden_size, moe)
        self.experts = Experts(hidden_size, moe, par)
        self.shared_experts = (
            SharedExperts(hidden_size, moe.shared_intermediate_size, par.tp_size)
            if moe.num_shared_experts
            else None
        )
        # [E] bool, set by record_expert_usage: which experts the steps since its reset chose
        self.touched: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H]
        weights, ids = self.gate(x)
        if self.touched is not None:  # a device op: CUDA graphs capture it too
            self.touched.index_fill_(0, ids.flatten(), True)
        out = self.experts(x, weights, ids)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return self.par.all_reduce_tp(out)

    def pack(self, prepack: bool = False) -> None:
        """The shared experts' gate/up (the routed experts are already one tensor per
        projection)."""
        if self.shared_experts is not None:
            self.shared_experts.pack(prepack)


def sparse_blocks(model: nn.Module) -> list[nn.Module]:
    """Every block of ``model`` that routes tokens to experts: a module with a router
    (``gate.weight`` [E, hidden]) and a ``touched`` slot (``SparseMoeBlock``, DeepSeek-V4's
    ``V4MoE``)."""
    found = []
    for m in model.modules():
        gate = getattr(m, "gate", None)
        if hasattr(m, "touched") and isinstance(getattr(gate, "weight", None), torch.Tensor):
            found.append(m)
    return found


def record_expert_usage(model: nn.Module) -> list[nn.Module]:
    """Make every sparse block of ``model`` mark the experts it routes to in its
    ``touched`` tensor (benchmarks: the bytes of the experts a decode step reads)."""
    blocks = sparse_blocks(model)
    for block in blocks:
        weight = getattr(block.gate, "weight", None)
        assert isinstance(weight, torch.Tensor)
        block.touched = torch.zeros(weight.shape[0], dtype=torch.bool, device=weight.device)
    return blocks


_EXPERT_KEY = re.compile(
    r"model\.layers\.(\d+)\.mlp\.experts\.(?:(\d+)\.|(gate_up_proj|down_proj)$)"
)


def read_local_experts(
    path: Path,
    moe: MoEConfig,
    tp_size: int,
    tp_rank: int,
    skip: Callable[[str], bool] = lambda key: False,
) -> dict[str, torch.Tensor]:
    """A safetensors file's tensors, of the routed experts only those TP rank ``tp_rank``
    holds (per-expert keys skipped, fused 3-D ones read as a slice): a rank never holds
    the whole expert set in memory. Keys ``skip`` names are not read (MTP layers)."""
    from safetensors import safe_open

    first, count = local_experts(moe.num_experts, tp_size, tp_rank)
    out: dict[str, torch.Tensor] = {}
    with safe_open(str(path), "pt", device="cpu") as f:
        for key in f.keys():  # noqa: SIM118 (a safe_open handle is not a dict)
            m = _EXPERT_KEY.match(key)
            if skip(key):
                continue
            if m is None or int(m[1]) not in moe.sparse_layers:
                out[key] = f.get_tensor(key)
            elif m[2] is not None:
                if first <= int(m[2]) < first + count:
                    out[key] = f.get_tensor(key)
            else:  # fused [E, ...]: this rank's rows
                out[key] = f.get_slice(key)[first : first + count]
    return out


def fuse_expert_weights(
    state: dict[str, torch.Tensor], moe: MoEConfig, tp_size: int = 1, tp_rank: int = 0
) -> dict[str, torch.Tensor]:
    """``state`` with each sparse layer's experts as ``mlp.experts.gate_up_proj`` [E_r, 2I, H]
    and ``mlp.experts.down_proj`` [E_r, H, I], only the E_r experts of TP rank ``tp_rank``.
    Takes the per-expert keys of ``save_pretrained`` and hub checkpoints
    (``mlp.experts.{e}.{gate,up,down}_proj.weight``) or the fused ones (transformers' in-memory
    names); other keys pass through."""
    first, count = local_experts(moe.num_experts, tp_size, tp_rank)
    out = dict(state)
    for layer in moe.sparse_layers:
        p = f"model.layers.{layer}.mlp.experts."
        if p + "gate_up_proj" in out:  # already fused: keep this rank's experts
            for name in ("gate_up_proj", "down_proj"):
                if out[p + name].shape[0] == moe.num_experts:  # not cut at read
                    out[p + name] = out[p + name].narrow(0, first, count)
            continue
        gate_up, down = [], []
        for e in range(moe.num_experts):
            keys = [f"{p}{e}.{proj}_proj.weight" for proj in ("gate", "up", "down")]
            if not first <= e < first + count:  # another rank's (maybe not even read)
                for k in keys:
                    out.pop(k, None)
                continue
            missing = [k for k in keys if k not in out]
            if missing:
                raise ModelLoadError(f"checkpoint lacks expert weights {missing[:2]}")
            gate, up, dn = (out.pop(k) for k in keys)
            gate_up.append(torch.cat([gate, up]))
            down.append(dn)
        out[p + "gate_up_proj"] = torch.stack(gate_up)
        out[p + "down_proj"] = torch.stack(down)
    return out
