"""Semantic checks of every decoded message at a service's boundary.

The typed decoders (common/runtime/protocol.py) guarantee shapes and types; these checks
guarantee meaning: a handle names at least one replica, its block ids lie inside the
producer's pool and match its token count, token ids lie inside the vocabulary, a
prefilled request carries its first token, sizes stay within limits. (Block ids past
the producer's pool are refused by the pull, against the pool its handshake declared.) A message that
fails one is answered ``Failed(bad_request)`` and counted (``pdserve:bad_messages``)
before anything reaches an engine thread, so no message can end one.

Each check returns None, or what is wrong in words (the ``Failed`` message).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pdserve.common.errors import RequestError
from pdserve.common.runtime import protocol as p

MAX_ID_CHARS = 256  # request and trace ids
MAX_REPLICAS = 1024  # TP x PCP of one producer instance
MAX_HEARTBEAT_IDS = 65536


@dataclass(frozen=True, kw_only=True)
class Limits:
    """What an engine accepts; published by the engine thread once the model is loaded."""

    vocab_size: int
    max_model_len: int
    num_ranks: int = 1  # replica ranks of this producer (prefill's side channel)


def check_ids(msg: object) -> str | None:
    for name in ("request_id", "trace_id"):
        value = getattr(msg, name, None)
        if isinstance(value, str) and len(value) > MAX_ID_CHARS:
            return f"{name} has {len(value)} characters, more than {MAX_ID_CHARS}"
    return None


def check_prompt(tokens: Sequence[int], limits: Limits) -> str | None:
    if not tokens:
        return "the prompt is empty"
    if len(tokens) > limits.max_model_len:
        return (
            f"the prompt has {len(tokens)} tokens, more than max_model_len {limits.max_model_len}"
        )
    bad = next((t for t in tokens if not 0 <= t < limits.vocab_size), None)
    if bad is not None:
        return f"token id {bad} is outside the vocabulary (0..{limits.vocab_size - 1})"
    return None


def check_sampling(sampling: p.SamplingParams, limits: Limits) -> str | None:
    try:
        sampling.validate(limits.vocab_size)
    except RequestError as exc:
        return str(exc)
    return None


def check_handle(handle: p.KVHandle, num_prompt_tokens: int) -> str | None:
    """A producer's KV handle as decode receives it."""
    if not handle.replicas:
        return "the KV handle names no replica"
    if len(handle.replicas) > MAX_REPLICAS:
        return f"the KV handle names {len(handle.replicas)} replicas, more than {MAX_REPLICAS}"
    grid = {(r.tp_rank, r.pcp_rank) for r in handle.replicas}
    if len(grid) != len(handle.replicas) or any(
        r.tp_rank < 0 or r.pcp_rank < 0 for r in handle.replicas
    ):
        return "the KV handle repeats a replica rank or names a negative one"
    layout = handle.layout
    if layout.num_blocks < 1 or layout.block_size < 1:
        return f"the KV handle's layout is empty: {layout.num_blocks} blocks of {layout.block_size}"
    if handle.num_tokens != num_prompt_tokens:
        return (
            f"the KV handle holds {handle.num_tokens} tokens but the prompt has {num_prompt_tokens}"
        )
    firsts = [handle.first_block, *handle.group_first_blocks]
    if min(firsts) < 0:
        return f"the KV handle's first_block is negative ({min(firsts)})"
    rates = handle.group_rates or [1] * len(firsts)
    if len(rates) != len(firsts) or min(rates) < 1:
        return f"the KV handle's group_rates {rates} do not fit its {len(firsts)} groups"
    entries = [-(-handle.num_tokens // (layout.block_size * rate)) for rate in rates]
    if any(first > num for first, num in zip(firsts, entries, strict=True)):
        return f"the KV handle's first_block {max(firsts)} is past its {max(entries)} entries"
    expected = sum(num - first for first, num in zip(firsts, entries, strict=True))
    if len(handle.block_ids) != expected:
        return (
            f"the KV handle lists {len(handle.block_ids)} blocks; {handle.num_tokens} tokens "
            f"from table entries {firsts} (one per KV cache group) need {expected}"
        )
    # Ids past the pool are the pull's to refuse, against the pool the producer's handshake
    # declared (not the handle's own claim): that failure follows kv_load_failure_policy
    # and releases the producer (tests/test_faults.py, wrong descriptors).
    if handle.host_slots:
        return check_host_slots(handle)
    bad = next((b for b in handle.block_ids if b < 0), None)
    if bad is not None:
        return f"block id {bad} is negative"
    if len(set(handle.block_ids)) != len(handle.block_ids):
        return "the KV handle lists a block twice"
    return None


def check_host_slots(handle: p.KVHandle) -> str | None:
    """A handle with host-tier blocks: each entry names a device block or a tier slot,
    exactly one of the two, none twice (ids past either pool are the pull's to refuse)."""
    if len(handle.host_slots) != len(handle.block_ids):
        return (
            f"the KV handle lists {len(handle.host_slots)} host slots for "
            f"{len(handle.block_ids)} blocks"
        )
    pairs = list(zip(handle.block_ids, handle.host_slots, strict=True))
    bad = next(((b, s) for b, s in pairs if (b < 0) == (s < 0) or min(b, s) < -1), None)
    if bad is not None:
        return f"block entry (device {bad[0]}, host slot {bad[1]}) names not exactly one place"
    device = [b for b in handle.block_ids if b >= 0]
    host = [s for s in handle.host_slots if s >= 0]
    if len(set(device)) != len(device) or len(set(host)) != len(host):
        return "the KV handle lists a block twice"
    return None


def check_prefill(msg: p.PrefillRequest, limits: Limits) -> str | None:
    return (
        check_ids(msg)
        or check_prompt(msg.prompt_token_ids, limits)
        or check_sampling(msg.sampling, limits)
    )


def check_decode(msg: p.DecodeRequest, limits: Limits) -> str | None:
    problem = (
        check_ids(msg)
        or check_prompt(msg.prompt_token_ids, limits)
        or check_sampling(msg.sampling, limits)
    )
    if problem is not None:
        return problem
    if not 0 <= msg.num_cached_tokens <= len(msg.prompt_token_ids):
        return (
            f"num_cached_tokens {msg.num_cached_tokens} is outside 0..{len(msg.prompt_token_ids)}"
        )
    if msg.handle is None:
        return None
    if msg.first_token is None:
        return "a request with a KV handle must carry the first token prefill sampled"
    if not 0 <= msg.first_token < limits.vocab_size:
        return (
            f"first token {msg.first_token} is outside the vocabulary (0..{limits.vocab_size - 1})"
        )
    return check_handle(msg.handle, len(msg.prompt_token_ids))


def check_release(msg: p.Release, limits: Limits) -> str | None:
    if not 0 <= msg.rank < limits.num_ranks:
        return f"release of rank {msg.rank}, but this producer has ranks 0..{limits.num_ranks - 1}"
    return check_ids(msg)


def check_heartbeat(msg: p.Heartbeat, limits: Limits) -> str | None:
    if len(msg.request_ids) > MAX_HEARTBEAT_IDS:
        return f"a heartbeat names {len(msg.request_ids)} requests, more than {MAX_HEARTBEAT_IDS}"
    return None


def check(msg: object, limits: Limits | None) -> str | None:
    """What is wrong with ``msg`` (None: nothing). Without ``limits`` (the engine is still
    loading) only what needs no model is checked."""
    if limits is None:
        if isinstance(msg, p.DecodeRequest) and msg.handle is not None:
            if msg.first_token is None:
                return "a request with a KV handle must carry the first token prefill sampled"
            return check_handle(msg.handle, len(msg.prompt_token_ids))
        return check_ids(msg)
    if isinstance(msg, p.PrefillRequest):
        return check_prefill(msg, limits)
    if isinstance(msg, p.DecodeRequest):
        return check_decode(msg, limits)
    if isinstance(msg, p.Release):
        return check_release(msg, limits)
    if isinstance(msg, p.Heartbeat):
        return check_heartbeat(msg, limits)
    return check_ids(msg)
