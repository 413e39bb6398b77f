"""A linear layer's GEMM as one callable: ``F.linear`` over its weight, or on CPU over a copy
of the weight that oneDNN has reordered once into its blocked layout.

At decode sizes (a few to 64 rows) the reordered GEMM is 1.2-1.7x faster on this project's
2-core CPU than ``F.linear``'s (benchmarks/README.md, "CPU at batch"); vLLM's CPU backend
does the same through its own oneDNN binding. The copy doubles the memory those weights
take, so it is an engine option (``cpu_weight_prepack``). CUDA and other dtypes keep
``F.linear``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# rows oneDNN picks the blocked layout for: decode batches; prefill's thousands of rows run
# as fast as with F.linear on that layout (measured: 0.98-1.17x at 512 rows)
ROWS_HINT = 64


def can_prepack(weight: torch.Tensor) -> bool:
    """Whether this torch build reorders ``weight`` for oneDNN: float32 on CPU, mkldnn on."""
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.float32
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    )


class Linear:
    """``x @ weight.T + bias`` for ``x`` of any leading shape."""

    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None, prepack: bool = False
    ) -> None:
        self.weight = weight
        self.bias = bias
        self.packed: torch.Tensor | None = None
        if prepack and can_prepack(weight):
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), ROWS_HINT)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is None or x.dtype != torch.float32:
            return F.linear(x, self.weight, self.bias)
        rows = x.reshape(-1, x.shape[-1])
        out = torch.ops.mkldnn._linear_pointwise(rows, self.packed, self.bias, "none", [], "")
        return out.view(*x.shape[:-1], out.shape[-1])


def pack_linears(linears: list[nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
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
