"""Routing of a mixture-of-experts layer in one Triton kernel: scores, the top-k experts
and their weights of each token, as common/model/layers/moe.py ``route`` computes them in torch
(~5 launches for Qwen3-MoE's softmax, ~15 for DeepSeek-V3's grouped sigmoid).

One program per token holds its E router logits (E <= 1024) in registers:

* ``SCORING`` 0 (softmax): scores = softmax(logits); the top-k scores, renormalised to
  sum 1 when ``NORM``;
* ``SCORING`` 1 (DeepSeek-V3): scores = sigmoid(logits); the choice on scores + bias,
  restricted to the ``TOPK_GROUP`` groups (of ``GROUPS``) whose two best choice values sum
  highest; weights are the chosen *scores*, renormalised (``+ 1e-20``) when ``NORM``,
  times ``scale``;
* ``SCORING`` 2 (DeepSeek-V4's ``Gate``): scores = sqrt(softplus(logits)) (softplus linear
  above 20, as torch's), the choice on scores + bias, or with ``HASH`` the experts given
  per token (``tid2eid[token id]``); weights the chosen scores over their sum (+ 1e-20),
  times ``scale``.

The top-k is k rounds of argmax (ties to the lower expert id) with the winner masked out,
in descending order; the reference's ``torch.topk(sorted=False)`` order is not defined,
and what follows (the experts' weighted sum) does not depend on it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.kernels.triton_common import _device_guard


@triton.jit
def _route_kernel(
    logits_ptr,  # [T, E]
    bias_ptr,  # [E] fp32 (read when HAS_BIAS)
    hash_ptr,  # [T, TOPK] int: the experts of each token (HASH); TOKENS: [vocab, TOPK]
    tokens_ptr,  # [T] int: each token's id, its row of hash_ptr (TOKENS)
    weights_ptr,  # [T, K] fp32
    ids_ptr,  # [T, K] int64
    E,
    stride_t,
    scale,
    TOPK: tl.constexpr,  # experts a token
    K: tl.constexpr,  # TOPK rounded up to a power of two (the stored range)
    BLOCK_E: tl.constexpr,
    SCORING: tl.constexpr,  # 0 softmax, 1 sigmoid, 2 sqrt(softplus)
    HASH: tl.constexpr,
    TOKENS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    GROUPS: tl.constexpr,  # n_group (1: no group restriction)
    PER_GROUP: tl.constexpr,  # E // GROUPS, a power of two when GROUPS > 1
    TOPK_GROUP: tl.constexpr,
    NORM: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, BLOCK_E)
    ok = e < E
    x = tl.load(logits_ptr + t * stride_t + e, mask=ok, other=float("-inf")).to(tl.float32)
    if SCORING == 1:
        scores = tl.where(ok, 1.0 / (1.0 + tl.exp(-x)), 0.0)
    elif SCORING == 2:
        soft = tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))
        scores = tl.where(ok, tl.sqrt(soft), 0.0)
    else:
        z = tl.exp(x - tl.max(x, axis=0))
        scores = z / tl.sum(z, axis=0)
    choice = scores
    if HAS_BIAS:
        choice = choice + tl.load(bias_ptr + e, mask=ok, other=0.0).to(tl.float32)
    choice = tl.where(ok, choice, float("-inf"))
    if GROUPS > 1:
        # a group's score: the sum of its two best choice values; keep the TOPK_GROUP best
        grouped = tl.reshape(choice, (GROUPS, PER_GROUP))
        j = tl.arange(0, PER_GROUP)
        best = tl.max(grouped, axis=1)
        first = tl.argmax(grouped, axis=1)
        second = tl.max(tl.where(j[None, :] == first[:, None], float("-inf"), grouped), axis=1)
        group_score = best + second if PER_GROUP > 1 else best
        g = tl.arange(0, GROUPS)
        keep = g < 0  # none yet
        for _ in tl.static_range(TOPK_GROUP):
            win = tl.argmax(group_score, axis=0)
            keep = keep | (g == win)
            group_score = tl.where(g == win, float("-inf"), group_score)
        choice = tl.reshape(tl.where(keep[:, None], grouped, float("-inf")), (BLOCK_E,))
    k = tl.arange(0, K)
    w = tl.zeros([K], tl.float32)
    ids = tl.zeros([K], tl.int64)
    hash_row = hash_ptr + t * TOPK
    if TOKENS:  # the table's row of the token id (V4's tid2eid[input_ids], no gather op)
        hash_row = hash_ptr + tl.load(tokens_ptr + t).to(tl.int64) * TOPK
    for i in tl.static_range(TOPK):
        if HASH:
            win = tl.load(hash_row + i).to(tl.int64)
        else:
            win = tl.argmax(choice, axis=0)
            choice = tl.where(e == win, float("-inf"), choice)
        w = tl.where(k == i, tl.sum(tl.where(e == win, scores, 0.0), axis=0), w)
        ids = tl.where(k == i, win.to(tl.int64), ids)
    if NORM:
        total = tl.sum(w, axis=0)
        if SCORING != 0:
            total += 1e-20
        w = w / total
    tl.store(weights_ptr + t * TOPK + k, w * scale, mask=k < TOPK)
    tl.store(ids_ptr + t * TOPK + k, ids, mask=k < TOPK)


SCORINGS = {"softmax": 0, "sigmoid": 1, "sqrtsoftplus": 2}


def route(
    logits: torch.Tensor,  # [T, E]
    top_k: int,
    norm_topk_prob: bool,
    scoring: str = "softmax",  # SCORINGS
    correction_bias: torch.Tensor | None = None,  # [E]
    n_group: int = 1,
    topk_group: int = 1,
    scale: float = 1.0,
    hash_ids: torch.Tensor | None = None,  # [T, k]: the experts given (V4's hash layers)
    token_ids: torch.Tensor | None = None,  # [T]: hash_ids is then the table [vocab, k]
) -> tuple[torch.Tensor, torch.Tensor]:  # (weights [T, k] fp32, ids [T, k] int64)
    num_tokens, num_experts = logits.shape
    assert 0 < top_k <= num_experts <= 1024, f"top {top_k} of {num_experts} experts (<= 1024)"
    per_group = num_experts // n_group
    if n_group > 1:
        assert num_experts & (num_experts - 1) == 0 and num_experts % n_group == 0, (
            f"{num_experts} experts in {n_group} groups: a power of two needed"
        )
    logits = logits.contiguous()
    weights = torch.empty((num_tokens, top_k), dtype=torch.float32, device=logits.device)
    ids = torch.empty((num_tokens, top_k), dtype=torch.int64, device=logits.device)
    if num_tokens:
        # the bias and the hash table read in their own dtypes (cast in the kernel: no copy)
        bias = None if correction_bias is None else correction_bias.contiguous()
        hashed = None if hash_ids is None else hash_ids.contiguous()
        rows = num_tokens if token_ids is None else hashed.shape[0] if hashed is not None else 0
        assert hashed is None or hashed.shape == (rows, top_k), "hash_ids: [T or vocab, k]"
        assert token_ids is None or (hashed is not None and token_ids.shape == (num_tokens,))
        with _device_guard(logits):
            _route_kernel[(num_tokens,)](
                logits,
                weights if bias is None else bias,
                ids if hashed is None else hashed,
                ids if token_ids is None else token_ids,
                weights,
                ids,
                num_experts,
                logits.stride(0),
                scale,
                TOPK=top_k,
                K=triton.next_power_of_2(top_k),
                BLOCK_E=triton.next_power_of_2(num_experts),
                SCORING=SCORINGS[scoring],
                HASH=hashed is not None,
                TOKENS=token_ids is not None,
                HAS_BIAS=bias is not None,
                GROUPS=n_group,
                PER_GROUP=per_group if n_group > 1 else 1,
                TOPK_GROUP=topk_group,
                NORM=norm_topk_prob,
            )
    return weights, ids
