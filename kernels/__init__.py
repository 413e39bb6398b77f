"""Paged-attention and pointwise kernels, with the implementation chosen at run time per call.

``write_kv``, ``prefill_attention`` and ``decode_attention`` have the signatures of
:mod:`pdserve.kernels.reference` (fp8 caches: per-tensor ``k_scale``/``v_scale``,
:mod:`pdserve.kernels.fp8`); ``rms_norm``, ``rotary`` and ``silu_and_mul`` those of
:mod:`pdserve.kernels.pointwise_ref` (Triton: :mod:`pdserve.kernels.triton_pointwise`). By default, CUDA tensors go to the Triton kernels
(:mod:`pdserve.kernels.triton_ops`) when triton imports, everything else to the torch
reference, whose attention and pointwise ops on float32 CPU tensors run the compiled
kernels of :mod:`pdserve.kernels.cpu_native` where they build for this CPU's ISA and beat
the reference on it (timed once per kernel, logged). ``PDSERVE_KERNELS=torch|triton`` forces
one (``torch``: the reference alone, no compiled kernel); Triton on CPU tensors runs only
through Triton's interpreter (``TRITON_INTERPRET=1``, set before triton is first imported).

triton is imported lazily, on the first call that picks it, so this package imports
without triton installed.
"""

from __future__ import annotations

import functools
import os
import sys
from types import ModuleType


def _defer_to_installed_kernels() -> None:
    """This folder imported by its bare name ``kernels`` (the repository root on sys.path:
    ``python -m`` or pytest run there) while Hugging Face's ``kernels`` package is installed
    (transformers >= 5.25 requires it and imports it): hand the importer that package
    instead, which the ``import`` statement then returns from sys.modules."""
    import importlib.machinery
    import importlib.util

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    elsewhere = [p for p in sys.path if os.path.abspath(p or os.curdir) != root]
    spec = importlib.machinery.PathFinder.find_spec("kernels", elsewhere)
    if spec is None or spec.loader is None:
        return  # none installed: importers see this package, as before
    module = importlib.util.module_from_spec(spec)
    sys.modules["kernels"] = module
    spec.loader.exec_module(module)


if __name__ == "kernels":
    _defer_to_installed_kernels()

import torch  # noqa: E402

from pdserve.kernels import (  # noqa: E402
    cpu_native,
    hyper_ref,
    indexer_ref,
    mla_reference,
    moe_ref,
    pointwise_ref,
    reference,
    sparse_mla_ref,
)
from pdserve.kernels.fp8 import is_fp8  # noqa: E402
from pdserve.kernels.indexer_ref import KeyFormat  # noqa: E402

ENV_VAR = "PDSERVE_KERNELS"
_BACKENDS = ("torch", "triton")

__all__ = [
    "ENV_VAR",
    "KeyFormat",
    "backend_name",
    "decode_attention",
    "decode_splits",
    "hyper_collapse",
    "hyper_mix",
    "indexer_topk",
    "mla_decode_attention",
    "mla_decode_splits",
    "prepare_cpu",
    "moe_experts",
    "moe_route",
    "prefill_attention",
    "rms_norm",
    "rotary",
    "silu_and_mul",
    "sparse_mla_attention",
    "write_cache_rows",
    "write_kv",
    "write_latent",
]


def _triton_interpret() -> bool:
    # The values that Triton itself reads as true.
    return os.environ.get("TRITON_INTERPRET", "").strip().lower() in ("1", "true", "on")


@functools.cache
def _triton_ops() -> ModuleType | ImportError:
    """The Triton kernels module, or the ImportError that importing it raised."""
    try:
        from pdserve.kernels import triton_ops
    except ImportError as exc:
        return exc
    return triton_ops


@functools.cache
def _triton_mla() -> ModuleType:
    from pdserve.kernels import triton_mla

    return triton_mla


@functools.cache
def _triton_pointwise() -> ModuleType:
    from pdserve.kernels import triton_pointwise

    return triton_pointwise


def backend_name(device: torch.device | str) -> str:
    """``"triton"`` or ``"torch"``: the implementation that tensors on ``device`` get."""
    device = torch.device(device)
    forced = os.environ.get(ENV_VAR, "").strip().lower()
    if forced and forced not in _BACKENDS:
        raise ValueError(f"{ENV_VAR}={forced!r}: expected one of {', '.join(_BACKENDS)}")
    if forced == "torch":
        return "torch"
    if forced == "triton":
        if device.type != "cuda" and not _triton_interpret():
            raise RuntimeError(
                f"{ENV_VAR}=triton with tensors on {device}: the Triton kernels need CUDA "
                "tensors, or TRITON_INTERPRET=1 to run them through Triton's interpreter"
            )
        ops = _triton_ops()
        if isinstance(ops, ImportError):
            raise ImportError(f"{ENV_VAR}=triton but the Triton kernels do not import: {ops}")
        return "triton"
    if device.type == "cuda" and not isinstance(_triton_ops(), ImportError):
        return "triton"
    return "torch"


def _impl(device: torch.device) -> ModuleType:
    if backend_name(device) == "triton":
        return _triton_ops()  # type: ignore[return-value]  # checked by backend_name
    return reference


def _pointwise(device: torch.device) -> ModuleType:
    if backend_name(device) == "triton":
        return _triton_pointwise()
    return pointwise_ref


def rms_norm(
    x: torch.Tensor,  # [T, hidden]
    weight: torch.Tensor,  # [hidden]
    eps: float,
    residual: torch.Tensor | None = None,  # [T, hidden], added to x first
) -> tuple[torch.Tensor, torch.Tensor | None]:  # (normalised, x + residual or None)
    if _native_pointwise(x.device, "rms_norm"):
        out = cpu_native.rms_norm(x, weight, eps, residual)
        if out is not None:
            return out
    return _pointwise(x.device).rms_norm(x, weight, eps, residual)


def rotary(
    q: torch.Tensor,  # [T, H_q, D]
    k: torch.Tensor,  # [T, H_kv, D]
    cos: torch.Tensor,  # [T, D]
    sin: torch.Tensor,  # [T, D]
) -> tuple[torch.Tensor, torch.Tensor]:  # rotated q, k (Triton: in place)
    if _native_pointwise(q.device, "rotary"):
        out = cpu_native.rotary(q, k, cos, sin)
        if out is not None:
            return out
    return _pointwise(q.device).rotary(q, k, cos, sin)


def silu_and_mul(gate_up: torch.Tensor, limit: float | None = None) -> torch.Tensor:
    """[T, 2I] -> [T, I]: silu(gate) * up; with ``limit`` the gate clamped above and
    the up on both sides at it first (DeepSeek-V4's experts)."""
    if limit is not None:
        return _pointwise(gate_up.device).silu_and_mul(gate_up, limit)
    if _native_pointwise(gate_up.device, "silu_and_mul"):
        out = cpu_native.silu_and_mul(gate_up)
        if out is not None:
            return out
    return _pointwise(gate_up.device).silu_and_mul(gate_up)


def write_kv(
    layer_cache: torch.Tensor,  # [N, 2, H_kv, B, D]
    k: torch.Tensor,  # [T, H_kv, D]
    v: torch.Tensor,  # [T, H_kv, D]
    slot_mapping: torch.Tensor,  # [T] int64, block_id * B + offset
    k_scale: float = 1.0,  # fp8 caches: stored = k / k_scale (kernels/fp8.py)
    v_scale: float = 1.0,
) -> None:
    _impl(layer_cache.device).write_kv(layer_cache, k, v, slot_mapping, k_scale, v_scale)


def prefill_attention(
    q: torch.Tensor,  # [T, H_q, D], sequences concatenated
    layer_cache: torch.Tensor,  # [N, 2, H_kv, B, D], already holding the new K/V
    cu_seqlens_q: torch.Tensor,  # [S + 1] int
    context_lens: torch.Tensor,  # [S] int, incl. the new tokens
    block_tables: torch.Tensor,  # [S, max_blocks] int
    scale: float,
    sliding_window: int | None = None,
    k_scale: float = 1.0,  # fp8 caches: K = stored * k_scale
    v_scale: float = 1.0,
    max_q_len: int | None = None,  # the longest query run if the host knows it (GPU: no sync)
) -> torch.Tensor:  # [T, H_q, D]
    impl = _impl(q.device)
    if impl is not reference:
        return impl.prefill_attention(
            q, layer_cache, cu_seqlens_q, context_lens, block_tables, scale, sliding_window,
            k_scale, v_scale, max_q_len,
        )  # fmt: skip
    if (
        q.device.type == "cpu"
        and not is_fp8(layer_cache.dtype)
        and _native_allowed("paged_prefill")
    ):
        out = cpu_native.prefill_attention(
            q, layer_cache, cu_seqlens_q, context_lens, block_tables, scale, sliding_window
        )
        if out is not None:
            return out
    return impl.prefill_attention(
        q,
        layer_cache,
        cu_seqlens_q,
        context_lens,
        block_tables,
        scale,
        sliding_window,
        k_scale,
        v_scale,
    )


def decode_attention(
    q: torch.Tensor,  # [S, H_q, D], one query token per sequence
    layer_cache: torch.Tensor,  # [N, 2, H_kv, B, D]
    context_lens: torch.Tensor,  # [S] int, incl. the token being decoded
    block_tables: torch.Tensor,  # [S, max_blocks] int
    scale: float,
    sliding_window: int | None = None,
    num_splits: int | None = None,  # decode_splits() of the (padded) batch; None: of this one
    k_scale: float = 1.0,  # fp8 caches: K = stored * k_scale
    v_scale: float = 1.0,
) -> torch.Tensor:  # [S, H_q, D]
    impl = _impl(q.device)
    if (
        impl is reference
        and q.device.type == "cpu"
        and not is_fp8(layer_cache.dtype)
        and _native_allowed("paged_decode")
    ):
        out = cpu_native.decode_attention(
            q, layer_cache, context_lens, block_tables, scale, sliding_window
        )
        if out is not None:
            return out
    return impl.decode_attention(
        q,
        layer_cache,
        context_lens,
        block_tables,
        scale,
        sliding_window,
        num_splits,
        k_scale,
        v_scale,
    )


def _native_pointwise(device: torch.device, kernel: str) -> bool:
    """Pointwise ops take the compiled CPU ones (kernels/cpu_native.py) where the torch
    reference would serve them and ``PDSERVE_KERNELS`` is not ``torch``."""
    return device.type == "cpu" and backend_name(device) == "torch" and _native_allowed(kernel)


def _native_allowed(kernel: str) -> bool:
    """CPU float32 ops take the compiled ``kernel`` (kernels/cpu_native.py) unless
    ``PDSERVE_KERNELS=torch`` asks for the reference alone, or it is not built here, or it
    lost to the reference on this CPU (cpu_native.chosen: timed once, logged)."""
    if os.environ.get(ENV_VAR, "").strip().lower() == "torch":
        return False
    return cpu_native.chosen(kernel)


def prepare_cpu() -> bool:
    """Build (or load) the compiled CPU kernels now and time each against the reference,
    before the first step needs them: True when some are in use."""
    if os.environ.get(ENV_VAR, "").strip().lower() == "torch" or cpu_native.load() is None:
        return False
    return any([cpu_native.chosen(k) for k in cpu_native.KERNELS])


def decode_splits(num_seqs: int, num_kv_heads: int, device: torch.device | str) -> int:
    """How many programs the Triton decode kernel splits each (sequence, KV head) over at
    this batch size (1 for the torch reference). It sets the summation order: a decode step
    and its CUDA-graph replay pass the same value to :func:`decode_attention`."""
    device = torch.device(device)
    if backend_name(device) != "triton":
        return 1
    splits: int = _impl(device).decode_splits(num_seqs, num_kv_heads, device)
    return splits


def _mla(device: torch.device) -> ModuleType:
    if backend_name(device) == "triton":
        return _triton_mla()
    return mla_reference


def write_latent(
    layer_cache: torch.Tensor,  # [N, 1, 1, B, D]: one layer of an MLA latent cache
    latent: torch.Tensor,  # [T, latent_dim + rope]
    slot_mapping: torch.Tensor,  # [T] int64, block_id * B + offset; negative: padding
    latent_dim: int | None = None,  # kv_lora_rank; needed by fp8_ds_mla (uint8) caches
) -> None:
    """A latent row per token into its slot; a uint8 cache holds each row as its
    fp8_ds_mla record (kernels/fp8_ds_mla.py), quantized here."""
    _mla(layer_cache.device).write_latent(layer_cache, latent, slot_mapping, latent_dim)


def mla_decode_attention(
    q: torch.Tensor,  # [S, H, D]: absorbed queries, latent part then rope part
    layer_cache: torch.Tensor,  # [N, 1, 1, B, D]
    context_lens: torch.Tensor,  # [S] int, incl. the token being decoded
    block_tables: torch.Tensor,  # [S, max_blocks] int
    scale: float,
    latent_dim: int,  # kv_lora_rank
    num_splits: int | None = None,  # mla_decode_splits() of the (padded) batch
) -> torch.Tensor:  # [S, H, latent_dim]
    """Absorbed MLA decode: every head attends the latent rows (key: the whole row, value:
    its first ``latent_dim`` values); kernels/mla_reference.py is the reference. A uint8
    cache holds fp8_ds_mla records, dequantized as they are read."""
    return _mla(q.device).mla_decode_attention(
        q, layer_cache, context_lens, block_tables, scale, latent_dim, num_splits
    )


def mla_decode_splits(num_seqs: int, num_heads: int, device: torch.device | str) -> int:
    """As :func:`decode_splits`, for the MLA decode kernel over ``num_heads`` query heads."""
    device = torch.device(device)
    if backend_name(device) != "triton":
        return 1
    splits: int = _triton_mla().mla_decode_splits(num_seqs, num_heads, device)
    return splits


def moe_experts(
    x: torch.Tensor,  # [T, H]
    topk_ids: torch.Tensor,  # [T, k] int64, global expert ids
    topk_weights: torch.Tensor,  # [T, k]
    gate_up: torch.Tensor,  # [E, 2I, H] this rank's experts
    down: torch.Tensor,  # [E, H, I]
    first_expert: int = 0,  # global id of this rank's expert 0
    limit: float | None = None,  # DeepSeek-V4: gate and up clamped at it (swiglu_limit)
    shared: tuple[torch.Tensor, torch.Tensor] | None = None,  # gate_up [2Is, H], down [H, Is]
) -> torch.Tensor:  # [T, H]: sum over this rank's experts of weight * expert(x)
    """Routed experts: on CUDA at decode sizes (T*k up to ``triton_moe_decode.enabled_pairs``:
    PDSERVE_MOE_DECODE_PAIRS, off by default until timed on a GPU) two Triton launches that read each touched expert once (:mod:`pdserve.kernels.
    triton_moe_decode`); past it (bf16 or fp32, sm90+) tokens sorted by expert and one
    grouped GEMM per projection (:mod:`pdserve.kernels.moe_grouped`); elsewhere, or with
    ``PDSERVE_KERNELS=torch``, the loop over experts of :mod:`pdserve.kernels.moe_ref`.
    ``shared``: a shared expert (the same clamped SwiGLU) added, weight 1: inside the decode
    kernels, elsewhere one GEMM, ``silu_and_mul`` and one GEMM, then an add."""
    out: torch.Tensor | None = None
    if backend_name(x.device) == "triton":
        from pdserve.kernels import moe_grouped, triton_moe_decode

        if triton_moe_decode.fits(x, topk_ids, gate_up, shared):
            return triton_moe_decode.moe_experts(
                x, topk_ids, topk_weights, gate_up, down, first_expert, limit, shared=shared
            )

        if moe_grouped.available(x, gate_up):
            out = moe_grouped.moe_experts(
                x, topk_ids, topk_weights, gate_up, down, first_expert, limit
            )
    if out is None:
        out = moe_ref.moe_experts(x, topk_ids, topk_weights, gate_up, down, first_expert, limit)
    if shared is None:
        return out
    gu = torch.nn.functional.linear(x, shared[0])
    return out + torch.nn.functional.linear(silu_and_mul(gu, limit), shared[1])


def hyper_mix(
    streams: torch.Tensor,  # [T, n, hidden]
    fn: torch.Tensor,  # [(2 + n) * n, n * hidden]
    base: torch.Tensor,  # [(2 + n) * n]
    scale: torch.Tensor,  # [3]
    eps: float,
    hc_eps: float,
    sinkhorn_iters: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # post [T, n], comb [T, n, n], input
    """DeepSeek-V4's hyper-connection weights and the block's input
    (:mod:`pdserve.kernels.hyper_ref`): on CUDA one Triton kernel
    (:mod:`pdserve.kernels.triton_hyper`), elsewhere the reference, op for op as
    transformers."""
    if backend_name(streams.device) == "triton":
        from pdserve.kernels import triton_hyper

        return triton_hyper.mix(streams, fn, base, scale, eps, hc_eps, sinkhorn_iters)
    return hyper_ref.mix(streams, fn, base, scale, eps, hc_eps, sinkhorn_iters)


def hyper_collapse(
    streams: torch.Tensor,  # [T, n, hidden]
    fn: torch.Tensor,  # [n, n * hidden]
    base: torch.Tensor,  # [n]
    scale: torch.Tensor,  # [1]
    eps: float,
    hc_eps: float,
) -> torch.Tensor:  # [T, hidden]
    """DeepSeek-V4's head collapse of the streams (as :func:`hyper_mix`)."""
    if backend_name(streams.device) == "triton":
        from pdserve.kernels import triton_hyper

        return triton_hyper.collapse(streams, fn, base, scale, eps, hc_eps)
    return hyper_ref.collapse(streams, fn, base, scale, eps, hc_eps)


def moe_route(
    logits: torch.Tensor,  # [T, E] router logits
    top_k: int,
    norm_topk_prob: bool,
    scoring: str,  # "softmax" (Qwen3-MoE), "sigmoid" (DeepSeek-V3, grouped), "sqrtsoftplus" (V4)
    correction_bias: torch.Tensor | None,
    n_group: int = 1,
    topk_group: int = 1,
    scale: float = 1.0,
    hash_ids: torch.Tensor | None = None,  # [T, k]: the experts given (V4's hash layers)
    token_ids: torch.Tensor | None = None,  # [T]: hash_ids is the table [vocab, k] (tid2eid)
) -> tuple[torch.Tensor, torch.Tensor] | None:  # (weights [T, k] fp32, ids [T, k] int64)
    """A router's top-k experts and weights in one Triton kernel
    (:mod:`pdserve.kernels.triton_route`) where the backend is Triton and the router fits
    it (at most 1024 experts; grouped: a power of two); None: the caller's torch route."""
    num_experts = logits.shape[1]
    if backend_name(logits.device) != "triton" or num_experts > 1024:
        return None
    if n_group > 1 and (num_experts & (num_experts - 1) or num_experts % n_group):
        return None
    from pdserve.kernels import triton_route

    return triton_route.route(
        logits, top_k, norm_topk_prob, scoring, correction_bias, n_group, topk_group, scale,
        hash_ids, token_ids,
    )  # fmt: skip


def indexer_topk(
    q: torch.Tensor,  # [T, H, D]: the indexer's queries
    weights: torch.Tensor,  # [T, H] float32: per head (callers fold in their other scales)
    key_cache: torch.Tensor,  # [N, B, row]: paged rows holding the keys
    key_format: KeyFormat,  # where a row holds its key and how it decodes
    block_tables: torch.Tensor,  # [S, max_blocks] int32
    query_seq: torch.Tensor,  # [T] int32: each query's row of block_tables
    num_visible: torch.Tensor,  # [T] int32: the query sees keys 0 .. n - 1
    topk: int,
    row_keys: torch.Tensor | None = None,  # [T] int32: each query's ranked width (below)
) -> torch.Tensor:  # [T, topk] int32 key indices, descending score, -1 pads at the end
    """The lightning indexer's selection (DeepSeek-V3.2, V4's CSA): per query the ``topk``
    visible keys of the highest ``sum_h weights[t, h] * relu(q[t, h] . key) * D**-0.5``
    (float32). ``row_keys``: the width of the row each query is ranked over, its
    sequence's keys at the step's end, as transformers ranks it (equal scores resolve by
    it: kernels/indexer_ref.py ``rank_rows``); None: the step's widest. The Triton path
    resolves ties its own way, the same at any width (kernels/triton_indexer.py), and
    takes no ``row_keys``. kernels/indexer_ref.py is the reference."""
    out: torch.Tensor
    if backend_name(q.device) == "triton":
        from pdserve.kernels import triton_indexer

        out = triton_indexer.indexer_topk(
            q, weights, key_cache, key_format, block_tables, query_seq, num_visible, topk
        )
    else:
        out = indexer_ref.indexer_topk(
            q, weights, key_cache, key_format, block_tables, query_seq, num_visible, topk,
            row_keys,
        )  # fmt: skip
    return out


def write_cache_rows(
    cache: torch.Tensor,  # [N, B, row]: one layer's rows (any dtype; uint8: bytes)
    rows: torch.Tensor,  # [T, row]: in the cache's dtype (fp8 rows: already quantized)
    slot_mapping: torch.Tensor,  # [T] int64, block_id * B + offset; negative: skipped
) -> None:
    """Each token's whole row into its slot (DeepSeek-V3.2's latent, rope and indexer key);
    the Triton path reads no host value (CUDA graphs capture it)."""
    if backend_name(cache.device) == "triton":
        from pdserve.kernels import triton_sparse_mla

        triton_sparse_mla.write_rows(cache, rows, slot_mapping)
        return
    sparse_mla_ref.write_rows(cache, rows, slot_mapping)


def sparse_mla_attention(
    q: torch.Tensor,  # [T, H, latent + rope]: absorbed queries (q_nope @ W_UK, q_rope)
    cache: torch.Tensor,  # [N, B, row]: one layer's V3.2 rows (uint8: fp8 records + key)
    latent_dim: int,  # kv_lora_rank
    block_tables: torch.Tensor,  # [S, max_blocks] int32
    query_seq: torch.Tensor,  # [T] int32: each query's row of block_tables
    indices: torch.Tensor,  # [T, topk] int32: the selected positions (indexer_topk), -1 none
    scale: float,
) -> torch.Tensor:  # [T, H, latent]
    """DeepSeek-V3.2's sparse MLA: each query attends only its selected rows (key: latent and
    rope, value: latent). kernels/sparse_mla_ref.py is the reference; Triton:
    kernels/triton_sparse_mla.py (fp8 records dequantized in the kernel)."""
    if backend_name(q.device) == "triton":
        from pdserve.kernels import triton_sparse_mla

        impl: ModuleType = triton_sparse_mla
    else:
        impl = sparse_mla_ref
    out: torch.Tensor = impl.sparse_mla_attention(
        q, cache, latent_dim, block_tables, query_seq, indices, scale
    )
    return out
