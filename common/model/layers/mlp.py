"""The gated SiLU MLP of a decoder layer (``gate_proj``, ``up_proj``, ``down_proj``: HF's
names), and the choice between it and a mixture-of-experts block per layer.

Tensor parallel: gate/up column-parallel, down_proj row-parallel followed by an all-reduce
over the TP group. On CUDA, :meth:`MLP.pack` puts gate/up into one matrix (one GEMM and one
``kernels.silu_and_mul`` instead of two GEMMs and two pointwise ops); the parameters stay,
as views into it, so the state dict keeps HF's names.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from pdserve import kernels
from pdserve.common.model.checkpoint.config import ModelConfig
from pdserve.common.model.layers.linear import Linear, pack_linears
from pdserve.common.model.layers.moe import SparseMoeBlock
from pdserve.common.parallel.context import ParallelContext


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, par: ParallelContext, layer: int = 0) -> None:
        super().__init__()
        self.par = par
        bias = cfg.mlp_bias
        size = cfg.intermediate_size // par.tp_size
        self.gate_proj = nn.Linear(cfg.hidden_size, size, bias=bias)
        self.up_proj = nn.Linear(cfg.hidden_size, size, bias=bias)
        self.down_proj = nn.Linear(size, cfg.hidden_size, bias=bias)
        # packed (pack): gate/up as one GEMM, down_proj's (without its bias under TP)
        self.gate_up: Linear | None = None
        self.down: Linear | None = None

    def pack(self, prepack: bool = False) -> None:
        self.gate_up = Linear(*pack_linears([self.gate_proj, self.up_proj]), prepack)
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


def sparse_or_dense_mlp(cfg: ModelConfig, par: ParallelContext, layer: int) -> nn.Module:
    """Layer ``layer``'s MLP: the experts of a sparse layer (common/model/layers/moe.py), else the
    dense one (a mixture-of-experts model's first layers, or its ``mlp_only_layers``)."""
    if cfg.moe is not None and cfg.is_moe_layer(layer):
        return SparseMoeBlock(cfg.hidden_size, cfg.moe, par)
    return MLP(cfg, par, layer)
