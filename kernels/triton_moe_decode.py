"""Routed experts at decode sizes in two Triton launches: no sort, weights read once.

At a few tokens the grouped GEMM of :mod:`pdserve.kernels.moe_grouped` runs about twice
the bytes floor of the experts it touches (it tiles for every group) and its sort,
gathers, masking and ``index_add_`` cost a dozen more launches. Here, for T tokens with
k experts each (the T*k (token, slot) *pairs*, at most :data:`MAX_PAIRS`):

1. ``_gate_up_kernel``, grid (pair, tile of I rows): the program of a pair that is the
   first pair of its expert (the lowest pair index routed to it; the others exit at once,
   as do pairs whose expert lives on another rank) reads the expert's gate and up rows of
   its tile once, multiplies them by the hidden states of *every* token routed to that
   expert (one ``tl.dot`` against the tokens' columns, unrouted columns zero), applies
   SiLU-and-mul (DeepSeek-V4's ``limit``: gate clamped above, up on both sides) and writes
   ``h`` [T*k, I] float32 for each of those pairs. So experts shared by tokens of a batch
   are read once, without sorting the pairs.
2. ``_down_kernel``, grid (token, tile of H): the token's weighted sum over its k slots of
   ``down[expert] @ (weight * h[pair])`` (that vector in the weights' dtype, as the
   reference's bf16 intermediate; the sum in float32), one flat loop over (slot, chunk of
   I) in order (no atomics: the same sum every run and every CUDA-graph replay), written
   [T, H] in x's dtype; non-local slots load nothing and add nothing.

``shared`` (a shared expert's ``gate_up`` [2Is, H] and ``down`` [H, Is], Is <= I: DeepSeek's
shared experts, a TP rank's slice of them) rides along as one more slot of weight 1 for
every token (SGLang calls this shared-experts fusion): one more program row of
``_gate_up_kernel`` computes its ``h`` for all the tokens (rows T*k.. of ``h``), and
``_down_kernel`` adds its down projection after the routed slots, in the same float32 sum,
so the block's ``routed + shared`` is these two launches, not five more.

Everything stays on the device with shapes fixed by T, k and the weights, so a decode
step that takes this path captures in a CUDA graph. kernels/moe_ref.py is the reference;
through ``TRITON_INTERPRET=1`` the kernels run on CPU (tests/test_moe_kernels.py).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from pdserve.kernels.triton_common import _device_guard

# The most (token, slot) pairs a call takes here; past it the grouped GEMM (its sort and
# launches amortised, its tiles full). 128: batch 16 at top-8, 21 at top-6.
MAX_PAIRS = 128
# Off by default until a GPU run has timed these kernels against the grouped path
# (`bash benchmarks/gpu.sh moe-decode`; none could be made in the session that wrote them):
# PDSERVE_MOE_DECODE_PAIRS=N takes them up to N pairs (at most MAX_PAIRS; 0: never), as the
# interpreter lane of scripts/test.sh and the A/B runs of bench engine do.
DEFAULT_PAIRS = 0
PAIRS_ENV = "PDSERVE_MOE_DECODE_PAIRS"


def enabled_pairs() -> int:
    """The most pairs a call takes the decode kernels for (PDSERVE_MOE_DECODE_PAIRS)."""
    return min(MAX_PAIRS, int(os.environ.get(PAIRS_ENV, DEFAULT_PAIRS)))


DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def fits(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    gate_up: torch.Tensor,
    shared: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> bool:
    """Whether this call takes the decode kernels: a few pairs, one float dtype (a shared
    expert's too, no wider than the routed ones)."""
    pairs = topk_ids.shape[0] * topk_ids.shape[1]
    return (
        0 < pairs <= enabled_pairs()
        and x.dtype in DTYPES
        and gate_up.dtype == x.dtype
        and gate_up.shape[1] % 2 == 0
        and gate_up.stride(2) == 1
        and (
            shared is None
            or (
                shared[0].dtype == shared[1].dtype == x.dtype
                and shared[0].shape[0] % 2 == 0
                and shared[0].shape[0] <= gate_up.shape[1]
                and shared[0].stride(1) == 1
                and shared[1].stride(1) == 1
            )
        )
    )


@triton.jit
def _gate_up_kernel(
    x_ptr,  # [T, H]
    ids_ptr,  # [T, K] global expert ids, contiguous
    w_ptr,  # [E, 2I, H]: rows [0, I) gate, [I, 2I) up
    h_ptr,  # [T*K (+ T: SHARED), I] float32
    ws_ptr,  # [2Is, H]: the shared expert's gate rows, then its up rows (SHARED)
    T,
    first,
    num_local,
    INTER,
    INTER_S,  # the shared expert's Is (SHARED)
    H,
    stride_xt,
    stride_we,
    stride_wr,
    stride_sr,
    stride_h,
    limit,
    K: tl.constexpr,
    KP: tl.constexpr,  # K rounded up to a power of two
    BLOCK_T: tl.constexpr,  # >= T, >= 16 (the dot's N)
    BLOCK_I: tl.constexpr,  # >= 16 (the dot's M)
    BLOCK_H: tl.constexpr,
    CLAMP: tl.constexpr,
    SHARED: tl.constexpr,  # program row T*K: the shared expert, every token's
    PRECISION: tl.constexpr,  # "ieee" for float32 (no tf32), else the default
    UPCAST: tl.constexpr,  # the interpreter (no bfloat16 arithmetic): the dots in fp32
):
    p = tl.program_id(0)
    is_shared = p >= T * K  # only with SHARED: the grid's last row
    e_glob = tl.where(is_shared, -1, tl.load(ids_ptr + tl.minimum(p, T * K - 1)))
    e = e_glob - first
    tok = tl.arange(0, BLOCK_T)
    slot = tl.arange(0, KP)
    in_t = tok < T
    pair = tok[:, None] * K + slot[None, :]  # [BLOCK_T, KP]
    ok = in_t[:, None] & (slot[None, :] < K)
    ids = tl.load(ids_ptr + pair, mask=ok, other=-1)
    hit = ok & (ids == e_glob)
    lead = tl.min(tl.min(tl.where(hit, pair, T * K), axis=1), axis=0)  # e's first pair
    n_inter = tl.where(is_shared, INTER_S, INTER)
    i0 = tl.program_id(1) * BLOCK_I
    if ((e >= 0) & (e < num_local) & (lead == p) | is_shared) & (i0 < n_inter):
        # [BLOCK_T]: tokens routed to e (the shared expert: every one)
        routed = (tl.max(hit.to(tl.int32), axis=1) > 0) | (in_t & (tok * 0 + p >= T * K))
        i = i0 + tl.arange(0, BLOCK_I)
        in_i = i < n_inter
        if is_shared:
            w_gate = ws_ptr + i[:, None].to(tl.int64) * stride_sr
            w_up = w_gate + INTER_S * stride_sr
        else:
            w_gate = w_ptr + e.to(tl.int64) * stride_we + i[:, None].to(tl.int64) * stride_wr
            w_up = w_gate + INTER * stride_wr
        gate = tl.zeros([BLOCK_I, BLOCK_T], tl.float32)
        up = tl.zeros([BLOCK_I, BLOCK_T], tl.float32)
        for h0 in range(0, H, BLOCK_H):
            hh = h0 + tl.arange(0, BLOCK_H)
            in_h = hh < H
            xt = tl.load(  # [BLOCK_H, BLOCK_T]: the routed tokens' columns, others zero
                x_ptr + tok[None, :].to(tl.int64) * stride_xt + hh[:, None],
                mask=routed[None, :] & in_h[:, None],
                other=0.0,
            )
            wmask = in_i[:, None] & in_h[None, :]
            wg = tl.load(w_gate + hh[None, :], mask=wmask, other=0.0)
            wu = tl.load(w_up + hh[None, :], mask=wmask, other=0.0)
            if UPCAST:
                xt, wg, wu = xt.to(tl.float32), wg.to(tl.float32), wu.to(tl.float32)
            gate = tl.dot(wg, xt, gate, input_precision=PRECISION)
            up = tl.dot(wu, xt, up, input_precision=PRECISION)
        if CLAMP:
            gate = tl.minimum(gate, limit)
            up = tl.minimum(tl.maximum(up, -limit), limit)
        act = gate / (1.0 + tl.exp(-gate)) * up  # [BLOCK_I, BLOCK_T]
        if is_shared:  # row T*K + t of every token t
            tl.store(
                h_ptr + (T * K + tok)[None, :].to(tl.int64) * stride_h + i[:, None],
                act,
                mask=in_t[None, :] & in_i[:, None],
            )
        else:
            for j in tl.static_range(K):  # each routed token's pair(s) of e
                pj = tok * K + j
                mine = in_t & (tl.load(ids_ptr + pj, mask=in_t, other=-1) == e_glob)
                tl.store(
                    h_ptr + pj[None, :].to(tl.int64) * stride_h + i[:, None],
                    act,
                    mask=mine[None, :] & in_i[:, None],
                )


@triton.jit
def _down_kernel(
    h_ptr,  # [T*K, I] float32
    ids_ptr,  # [T, K] contiguous
    weights_ptr,  # [T, K] contiguous
    d_ptr,  # [E, H, I]
    ds_ptr,  # [H, Is]: the shared expert's down (SHARED)
    out_ptr,  # [T, H]
    T,
    first,
    num_local,
    INTER,
    INTER_S,
    H,
    stride_de,
    stride_dr,
    stride_dsr,
    stride_h,
    stride_ot,
    K: tl.constexpr,
    BLOCK_O: tl.constexpr,  # >= 16 (the dot's M)
    BLOCK_K: tl.constexpr,
    SHARED: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    t = tl.program_id(0)
    o = tl.program_id(1) * BLOCK_O + tl.arange(0, BLOCK_O)
    in_o = o < H
    rows = o[:, None].to(tl.int64) * stride_dr
    col = tl.arange(0, 16)
    acc = tl.zeros([BLOCK_O, 16], tl.float32)  # column 0 the sum, the others stay zero
    chunks = tl.cdiv(INTER, BLOCK_K)
    # one flat loop over (slot, chunk of I), slots in order (a fixed summation order, and
    # one loop whose weight loads the compiler pipelines across experts: a GEMV as a dot
    # on one column of 16); another rank's slot loads nothing
    for it in range(0, K * chunks):
        j = it // chunks
        kk = (it - j * chunks) * BLOCK_K + tl.arange(0, BLOCK_K)
        p = t * K + j
        e = tl.load(ids_ptr + p) - first
        # the slot's columns: I of them, none when its expert is another rank's
        in_k = kk < tl.where((e >= 0) & (e < num_local), INTER, 0)
        hv = tl.load(h_ptr + p.to(tl.int64) * stride_h + kk, mask=in_k, other=0.0)
        hv = hv * tl.load(weights_ptr + p).to(tl.float32)
        hcol = tl.where(col[None, :] == 0, hv[:, None], 0.0)  # [BLOCK_K, 16]
        wd = tl.load(
            d_ptr + e.to(tl.int64) * stride_de + rows + kk[None, :],
            mask=in_o[:, None] & in_k[None, :],
            other=0.0,
        )
        if UPCAST:
            wd = wd.to(tl.float32)
        acc = tl.dot(wd, hcol.to(wd.dtype), acc, input_precision=PRECISION)
    if SHARED:  # the shared expert last, weight 1: h's row T*K + t
        p = T * K + t
        for c in range(0, tl.cdiv(INTER_S, BLOCK_K)):
            kk = c * BLOCK_K + tl.arange(0, BLOCK_K)
            in_k = kk < INTER_S
            hv = tl.load(h_ptr + p.to(tl.int64) * stride_h + kk, mask=in_k, other=0.0)
            hcol = tl.where(col[None, :] == 0, hv[:, None], 0.0)
            wd = tl.load(
                ds_ptr + o[:, None].to(tl.int64) * stride_dsr + kk[None, :],
                mask=in_o[:, None] & in_k[None, :],
                other=0.0,
            )
            if UPCAST:
                wd = wd.to(tl.float32)
            acc = tl.dot(wd, hcol.to(wd.dtype), acc, input_precision=PRECISION)
    total = tl.sum(acc, axis=1)
    tl.store(
        out_ptr + t.to(tl.int64) * stride_ot + o, total.to(out_ptr.dtype.element_ty), mask=in_o
    )


# True when TRITON_INTERPRET was set as this module was imported.
_INTERPRETED = not isinstance(_gate_up_kernel, triton.runtime.JITFunction)


def config(num_tokens: int, inter: int, hidden: int) -> dict[str, int]:
    """Tile sizes (not yet swept on a GPU: benchmarks/moe_decode.py --sweep). A GEMV runs
    at the bytes it keeps in flight per SM: both kernels' weight loads feed a ``tl.dot``,
    so the compiler pipelines them (cp.async, ``num_stages`` - 1 tiles ahead). Gate/up:
    BLOCK_I 16 (the dot's least M: the most programs per expert at batch 1) by BLOCK_H
    256, 16 KiB of bf16 weights a stage; down, H / BLOCK_O programs a token (128 at
    hidden 2048: one an SM at batch 1), a 16 x 256 tile of 8 KiB a stage, 4 stages."""
    block_t = max(16, triton.next_power_of_2(num_tokens))
    return {
        "block_i": 16,
        "block_h": 256 if block_t <= 16 else 128,
        "block_o": 16,
        "block_k": max(16, min(256, triton.next_power_of_2(inter))),
        "warps_gate_up": 4,
        "warps_down": 4,
        "stages_gate_up": 3,
        "stages_down": 4,
    }


def moe_experts(
    x: torch.Tensor,  # [T, H]
    topk_ids: torch.Tensor,  # [T, k] global expert ids
    topk_weights: torch.Tensor,  # [T, k]
    gate_up: torch.Tensor,  # [E, 2I, H]: rows [0, I) gate, [I, 2I) up
    down: torch.Tensor,  # [E, H, I]
    first_expert: int = 0,
    limit: float | None = None,  # DeepSeek-V4's swiglu_limit
    tiles: dict[str, int] | None = None,  # config()'s keys, to override (benchmarks)
    shared: tuple[torch.Tensor, torch.Tensor] | None = None,  # gate_up [2Is, H], down [H, Is]
) -> torch.Tensor:  # [T, H] in x's dtype: sum over this rank's experts of weight * expert(x)
    """The routed experts' weighted sum (plus ``shared``'s output, weight 1, when given)."""
    num_tokens, top_k = topk_ids.shape
    num_local, two_inter, hidden = gate_up.shape
    inter = two_inter // 2
    assert down.shape == (num_local, hidden, inter), (down.shape, gate_up.shape)
    assert x.shape == (num_tokens, hidden)
    if x.stride(1) != 1:
        x = x.contiguous()
    assert gate_up.stride(2) == 1 and down.stride(2) == 1
    out = torch.empty((num_tokens, hidden), dtype=x.dtype, device=x.device)
    if num_tokens == 0:
        return out
    ids = topk_ids.contiguous()
    weights = topk_weights.contiguous()
    inter_s = 0
    if shared is not None:
        inter_s = shared[0].shape[0] // 2
        assert inter_s <= inter and shared[1].shape == (hidden, inter_s), (
            tuple(shared[0].shape),
            tuple(shared[1].shape),
            inter,
        )
    # every (pair, I row) written below is one of a local expert, read only for those; then
    # the shared expert's row of each token
    rows = num_tokens * top_k + (num_tokens if shared is not None else 0)
    h = torch.empty((rows, inter), dtype=torch.float32, device=x.device)
    ws, ds = shared if shared is not None else (gate_up, down)
    cfg = config(num_tokens, inter, hidden)
    cfg.update(tiles or {})
    block_t = max(16, triton.next_power_of_2(num_tokens))
    precision = "ieee" if x.dtype == torch.float32 or _INTERPRETED else "tf32"  # no tf32
    with _device_guard(x):
        programs = num_tokens * top_k + (1 if shared is not None else 0)
        _gate_up_kernel[(programs, triton.cdiv(inter, cfg["block_i"]))](
            x, ids, gate_up, h, ws,
            num_tokens, first_expert, num_local, inter, inter_s, hidden,
            x.stride(0), gate_up.stride(0), gate_up.stride(1), ws.stride(0), h.stride(0),
            0.0 if limit is None else float(limit),
            K=top_k, KP=triton.next_power_of_2(top_k), BLOCK_T=block_t,
            BLOCK_I=cfg["block_i"], BLOCK_H=cfg["block_h"], CLAMP=limit is not None,
            SHARED=shared is not None, PRECISION=precision, UPCAST=_INTERPRETED,
            num_warps=cfg["warps_gate_up"], num_stages=cfg["stages_gate_up"],
        )  # fmt: skip
        _down_kernel[(num_tokens, triton.cdiv(hidden, cfg["block_o"]))](
            h, ids, weights, down, ds, out,
            num_tokens, first_expert, num_local, inter, inter_s, hidden,
            down.stride(0), down.stride(1), ds.stride(-2), h.stride(0), out.stride(0),
            K=top_k, BLOCK_O=cfg["block_o"], BLOCK_K=cfg["block_k"], SHARED=shared is not None,
            PRECISION=precision, UPCAST=_INTERPRETED,
            num_warps=cfg["warps_down"], num_stages=cfg["stages_down"],
        )  # fmt: skip
    return out
