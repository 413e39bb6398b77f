"""Ceilings for ``pdserve bench engine``, measured on the machine of the run.

* memory floor of a decode step: the bytes it must read (every weight once, plus the K/V
  of every cached token of every sequence) over the device's copy bandwidth, counted as
  read + write traffic (a copy of N bytes moves 2N), i.e. what memory delivers. For a
  mixture-of-experts model only the routed experts the step's tokens chose count (the
  distinct (layer, expert) pairs, counted on the run's own decode steps), not all of them.
  Of the cache, what a step's attention must read (``context_terms``): every row for
  dense and MLA attention; DeepSeek-V3.2 (DSA) every token's indexer key but only the
  ``index_topk`` selected latent rows; DeepSeek-V4 the window's rows of every layer, of a
  CSA layer every compressed entry's indexer key and the ``index_topk`` selected entries,
  of an HCA layer every compressed entry (the compressors' pooling state not counted);
* compute floor of a prefill: its matmul FLOPs (2 x parameters x tokens for the linear
  layers, plus causal attention's QK^T and PV) over the measured dense matmul rate in the
  run's dtype.

A step at its floor would use the whole bandwidth (or every tensor core) for nothing but
the unavoidable: ``step / floor`` is how far from it the engine runs.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pdserve.common.model.family_api import family_for

if TYPE_CHECKING:
    import torch

    from pdserve.common.engine.llm_engine import LLMEngine
    from pdserve.common.model.checkpoint.config import ModelConfig


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
    # the cache bytes a sequence's decode step reads at context c: the sum over the terms
    # (bytes, rate, cap) of bytes * min(c / rate, cap) (cap 0: none); default (no terms):
    # c * kv_bytes_per_token
    context_terms: list[tuple[int, int, int]] = field(default_factory=list)


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
    # QK^T over the q/k head, PV over the v head (the family's: MLA expands its latent)
    qk_dim, v_dim = family_for(cfg).attention_dims(cfg)
    routed, per_expert, routed_2d = routed_experts(runner.model)
    linear -= routed_2d  # experts kept as 2-D matrices (DeepSeek-V4's): counted as active below
    sparse_layers, top_k = _sparse_layers(cfg)
    if sparse_layers:  # each token runs top_k experts of each sparse layer
        active = top_k * sparse_layers * per_expert
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
        context_terms=context_terms(cfg, runner.layout.bytes_per_token),
    )


def routed_experts(model: Any) -> tuple[int, int, int]:
    """(bytes of every routed expert of every sparse block, bytes of one expert of one
    block, parameters of the routed experts held as 2-D matrices) of ``model``: the blocks
    common/model/layers/moe.py ``sparse_blocks`` finds (Qwen3-MoE's and DeepSeek's stacked
    experts, DeepSeek-V4's per-expert modules)."""
    from pdserve.common.model.layers.moe import sparse_blocks

    routed = per_expert = matrices = 0
    for block in sparse_blocks(model):
        experts = block.experts
        params = {p.data_ptr(): p for p in experts.parameters()}.values()
        size = sum(p.numel() * p.element_size() for p in params)
        gate_up = getattr(experts, "gate_up_proj", None)
        count = len(experts) if gate_up is None else gate_up.shape[0]
        routed += size
        per_expert = size // max(1, count)
        matrices += sum(p.numel() for p in params if p.dim() == 2)
    return routed, per_expert, matrices


def _sparse_layers(cfg: ModelConfig) -> tuple[int, int]:
    """(sparse layers, experts a token runs in each) of the model."""
    if cfg.moe is not None:
        return len(cfg.moe.sparse_layers), cfg.moe.top_k
    if cfg.v4 is not None:
        return cfg.num_hidden_layers, cfg.v4.top_k
    return 0, 0


def context_terms(cfg: ModelConfig, bytes_per_token: int) -> list[tuple[int, int, int]]:
    """What a decode step of one sequence reads of its cache, as (bytes, rate, cap) terms
    (``Ceilings.context_terms``). The element size is the cache's: its bytes a token over
    the values a token (fp8 caches: about one byte a value, scales counted in)."""
    layers = cfg.num_hidden_layers
    v4 = cfg.v4
    if v4 is not None:
        from pdserve.common.model.deepseek.dsv4_config import CSA, HCA

        width = v4.row_width(cfg.head_dim)
        per_value = bytes_per_token / (layers * width)
        row = round(cfg.head_dim * per_value)
        index_key = round(v4.index_head_dim * per_value)
        window = cfg.sliding_window or 0
        csa = sum(1 for k in v4.layer_kinds if k == CSA)
        hca = sum(1 for k in v4.layer_kinds if k == HCA)
        terms = [(layers * row, 1, window)]
        if csa:
            rate = v4.compress_rates[CSA]
            terms += [(csa * index_key, rate, 0), (csa * row, rate, v4.index_topk)]
        if hca:
            terms.append((hca * row, v4.compress_rates[HCA], 0))
        return [t for t in terms if t[0]]
    if cfg.is_indexed:  # DSA: every indexer key, the selected latent rows
        width = cfg.kv_lora_rank + cfg.qk_rope_head_dim + cfg.index_head_dim
        index_key = round(bytes_per_token * cfg.index_head_dim / width)
        return [(index_key, 1, 0), (bytes_per_token - index_key, 1, cfg.index_topk)]
    return [(bytes_per_token, 1, 0)]


def context_bytes(c: Ceilings, context: float) -> float:
    """Bytes one sequence's decode step reads of its cache at ``context`` tokens."""
    if not c.context_terms:
        return context * c.kv_bytes_per_token
    total = 0.0
    for size, rate, cap in c.context_terms:
        entries = context / rate
        total += size * (min(entries, cap) if cap else entries)
    return total


def decode_floor_s(
    c: Ceilings, batch: int, mean_context: float, experts_touched: float | None = None
) -> float:
    """Seconds a decode step of ``batch`` sequences must take reading its bytes;
    ``experts_touched``: the (layer, expert) pairs a step reads, of a MoE model."""
    weights = c.weight_bytes
    if experts_touched is not None:
        weights += experts_touched * c.expert_bytes - c.routed_expert_bytes
    return (weights + batch * context_bytes(c, mean_context)) / (c.copy_gbps * 1e9)


def prefill_floor_s(c: Ceilings, batch: int, prompt_len: int) -> float:
    """Seconds the matmuls of a prefill of ``batch`` prompts take at the measured rate
    (logits for the last token only, causal attention: prompt_len^2 / 2 pairs)."""
    flops = 2 * c.linear_params * batch * prompt_len + 2 * c.head_params * batch
    flops += c.attn_flops_per_pair * batch * prompt_len * (prompt_len + 1) // 2
    return flops / (c.matmul_tflops * 1e12)
