"""Tensor-parallel sharding and the KV pull plan between TP layouts (pure, no torch).

A TP rank holds ``num_heads / tp`` query heads and a slice of the KV heads: ``K / tp`` of
them when ``tp <= K``, else one KV head replicated on ``tp / K`` ranks (rank r holds head
``r // (tp / K)``). Query head q attends with KV head ``q // (H / K)`` in both cases.

A decode rank needs the KV heads it holds; :func:`pull_plan` says, for each of them, which
prefill TP rank holds it and at which local index, merged into slices of adjacent heads.
"""

from __future__ import annotations

from typing import NamedTuple


class HeadSlice(NamedTuple):
    """Heads [src_head, src_head + num_heads) of producer TP rank ``producer_tp_rank`` go to
    local heads [dst_head, dst_head + num_heads)."""

    producer_tp_rank: int
    src_head: int
    dst_head: int
    num_heads: int


def check_tp(tp: int, num_heads: int, num_kv_heads: int, intermediate_size: int) -> str | None:
    """Why ``tp`` cannot shard this model, or None when it can."""
    if tp < 1:
        return f"tensor parallel size must be >= 1, got {tp}"
    if num_heads % tp:
        return f"{num_heads} attention heads do not split over TP {tp}"
    if intermediate_size % tp:
        return f"MLP size {intermediate_size} does not split over TP {tp}"
    if num_kv_heads % tp and tp % num_kv_heads:
        return f"{num_kv_heads} KV heads neither split over nor replicate onto TP {tp}"
    return None


def kv_heads_of(num_kv_heads: int, tp: int, rank: int) -> tuple[int, int]:
    """(first, count) of the global KV heads TP rank ``rank`` holds."""
    if tp <= num_kv_heads:
        per = num_kv_heads // tp
        return rank * per, per
    return rank // (tp // num_kv_heads), 1


def q_heads_of(num_heads: int, tp: int, rank: int) -> tuple[int, int]:
    per = num_heads // tp
    return rank * per, per


def pull_plan(
    num_kv_heads: int, producer_tp: int, consumer_tp: int, consumer_rank: int
) -> list[HeadSlice]:
    """Where consumer rank ``consumer_rank`` reads each of its KV heads from.

    decode TP > prefill TP: one slice of one producer rank; decode TP < prefill TP: one
    slice from each of several producer ranks; equal: rank d reads all of rank d. When the
    producer replicates a head on several ranks, consumers spread over the copies.
    """
    first, count = kv_heads_of(num_kv_heads, consumer_tp, consumer_rank)
    slices: list[HeadSlice] = []
    for dst, head in enumerate(range(first, first + count)):
        if producer_tp <= num_kv_heads:
            per = num_kv_heads // producer_tp
            rank, src = head // per, head % per
        else:
            copies = producer_tp // num_kv_heads
            rank, src = head * copies + consumer_rank % copies, 0
        last = slices[-1] if slices else None
        if last and last.producer_tp_rank == rank and last.src_head + last.num_heads == src:
            slices[-1] = last._replace(num_heads=last.num_heads + 1)
        else:
            slices.append(HeadSlice(rank, src, dst, 1))
    return slices
