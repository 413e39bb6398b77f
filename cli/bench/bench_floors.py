"""Ceilings for ``pdserve bench engine``, measured on the machine of the run.

* memory floor of a decode step: the bytes it must read (every weight once, plus the K/V
  of every cached token of every sequence) over the device's copy bandwidth, counted as
  read + write traffic (a copy of N bytes moves 2N), i.e. what memory delivers. For a
  mixture-of-experts model only the routed experts the step's tokens chose count (the
  distinct (layer, expert) pairs, counted on the run's own decode steps), not all of them;
* compute floor of a prefill: its matmul FLOPs (2 x parameters x tokens for the linear
  layers, plus causal attention's QK^T and PV) over the measured dense matmul rate in the
  run's dtype.

A step at its floor would use the whole bandwidth (or every tensor core) for nothing but
the unavoidable: ``step / floor`` is how far from it the engine runs.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from pdserve.common.engine.llm_engine import LLMEngine


@dataclass
class Ceilings:
    copy_gbps: float  # read + write bytes per second of a large device copy, in 1e9
    matmul_tflops: float  # dense matmul, the run's dtype
    weight_bytes: int  # every parameter once (tied embeddings once)
    kv_bytes_per_token: int  # all layers, K and V (MLA: the latent row)
    linear_params: int  # parameters of the matmuls every token goes through (not the LM head;
    # of a MoE layer, its top_k experts)
    head_params: int  # the LM head: prefill runs it for the last token of a prompt only
    attn_flops_per_pair: int  # QK^T + PV flops for one (query, key) pair, all layers
    routed_expert_bytes: int = 0  # every routed expert of every sparse layer (in weight_bytes)
    expert_bytes: int = 0  # one routed expert of one layer


def _sync(device: torch.device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _best(fn, repeats: int = 5) -> float:  # noqa: ANN001
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def _copy_seconds(device: torch.device, size: int) -> float:
    """Best time of a ``size``-byte device copy; the buffers are freed on return."""
    import torch

    src = torch.empty(size, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)

    def copy() -> None:
        dst.copy_(src)
        _sync(device)

    copy()
    return _best(copy)


def measure(engine: LLMEngine) -> Ceilings:
    import torch

    runner = engine.runner
    device, dtype = runner.device, runner.dtype
    cfg = engine.model_config
    size = 2**30 if device.type == "cuda" else 2**28
    copy_s = _copy_seconds(device, size)
    n = 8192 if device.type == "cuda" else 1024
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)

    def matmul() -> None:
        for _ in range(4):
            torch.matmul(a, b)
        _sync(device)

    matmul()
    mm_s = _best(matmul) / 4
    params = {p.data_ptr(): p for p in runner.model.parameters()}.values()
    weight_bytes = sum(p.numel() * p.element_size() for p in params)
    embed = cfg.vocab_size * cfg.hidden_size
    matrices = sum(p.numel() for p in params if p.dim() == 2)
    linear = matrices - embed * (1 if cfg.tie_word_embeddings else 2)  # less lookup and LM head
    # QK^T over the q/k head, PV over the v head (MLA prefill expands the latent to these)
    if cfg.is_mla:
        qk_dim, v_dim = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, cfg.v_head_dim
    else:
        qk_dim = v_dim = cfg.head_dim
    experts = [
        (t.numel() * t.element_size(), t.shape[0])
        for name, t in runner.model.named_parameters()
        if name.endswith(("experts.gate_up_proj", "experts.down_proj"))
    ]
    routed = sum(b for b, _ in experts)
    per_expert = sum(b // n for b, n in experts) // max(1, len(experts) // 2)
    if cfg.moe is not None:  # each token runs top_k experts of each sparse layer
        active = cfg.moe.top_k * len(cfg.moe.sparse_layers) * per_expert
        linear += active // runner.model.model.embed_tokens.weight.element_size()
    return Ceilings(
        copy_gbps=2 * size / copy_s / 1e9,
        matmul_tflops=2 * n**3 / mm_s / 1e12,
        weight_bytes=weight_bytes,
        kv_bytes_per_token=runner.layout.bytes_per_token,
        linear_params=linear,
        head_params=embed,
        attn_flops_per_pair=2 * cfg.num_attention_heads * (qk_dim + v_dim) * cfg.num_hidden_layers,
        routed_expert_bytes=routed,
        expert_bytes=per_expert,
    )


def decode_floor_s(
    c: Ceilings, batch: int, mean_context: float, experts_touched: float | None = None
) -> float:
    """Seconds a decode step of ``batch`` sequences must take reading its bytes;
    ``experts_touched``: the (layer, expert) pairs a step reads, of a MoE model."""
    weights = c.weight_bytes
    if experts_touched is not None:
        weights += experts_touched * c.expert_bytes - c.routed_expert_bytes
    return (weights + batch * mean_context * c.kv_bytes_per_token) / (c.copy_gbps * 1e9)


def prefill_floor_s(c: Ceilings, batch: int, prompt_len: int) -> float:
    """Seconds the matmuls of a prefill of ``batch`` prompts take at the measured rate
    (logits for the last token only, causal attention: prompt_len^2 / 2 pairs)."""
    flops = 2 * c.linear_params * batch * prompt_len + 2 * c.head_params * batch
    flops += c.attn_flops_per_pair * batch * prompt_len * (prompt_len + 1) // 2
    return flops / (c.matmul_tflops * 1e12)
