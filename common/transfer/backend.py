"""The KV transfer seam: what the services need of whatever moves KV blocks between a
producer's cache and a consumer's, split by role as the field does (vLLM's connector has a
scheduler side and a worker side; SGLang's disaggregation a sender and a receiver per
backend).

- The producer role (``KVProducerRole``, a prefill rank): registers its cache (and its
  host tier's, when it has one: a handle may name tier slots, ``KVHandle.host_slots``),
  publishes a ``HandshakeReply`` consumers connect with, and reports the releases they
  send.
- The consumer role (``Puller`` of common/transfer/kv_pulls.py, a decode rank): connects
  to producers from their handshakes, pulls blocks into its cache, releases them.

A ``TransferBackend`` makes both. The wire carries a producer's handshake as a
``HandshakeReply``: the fields every backend shares (engine, epoch, replica name, layout,
compat, grid position) and ``payload``, bytes only its backend reads (NIXL: agent metadata,
cache address, memory kind). Backends are found by name in common/transfer/registry.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from pdserve.common.engine.kv_layout import KVLayout
from pdserve.common.runtime.protocol import HandshakeReply, KVHandle, Release

if TYPE_CHECKING:
    import torch

    from pdserve.common.transfer.kv_pulls import Puller


@dataclass(frozen=True, kw_only=True)
class CacheSpec:
    """One rank's KV cache as a backend registers it."""

    agent_name: str  # the replica's name in its backend, unique among the live ones
    kv_cache: torch.Tensor  # logical [N, L, 2, H_kv, B, D] view (common/engine/kv_cache.py)
    layout: KVLayout
    compat: dict[str, Any]  # what must agree with a peer's (ModelRunner.kv_compat)


@dataclass(frozen=True, kw_only=True)
class ProducerSpec(CacheSpec):
    engine_id: str
    epoch: int  # this life's: handles of another are refused
    # The host tier's bytes (common/engine/tier_buffer.py), served too: a handle's
    # host_slots name blocks of it. Logical [S, L, 2, H_kv, B, D] of a block-order layout.
    host_cache: torch.Tensor | None = None
    host_layout: KVLayout | None = None
    tp_rank: int = 0
    tp_size: int = 1
    pcp_rank: int = 0
    pcp_size: int = 1

    def reply(self, backend: str, payload: bytes) -> HandshakeReply:
        """The handshake of this rank, ``payload`` read by ``backend`` alone."""
        return HandshakeReply(
            engine_id=self.engine_id,
            epoch=self.epoch,
            agent_name=self.agent_name,
            layout=self.layout,
            compat=dict(self.compat),
            tp_rank=self.tp_rank,
            tp_size=self.tp_size,
            pcp_rank=self.pcp_rank,
            pcp_size=self.pcp_size,
            backend=backend,
            payload=payload,
        )


class KVProducerRole(Protocol):
    """A prefill rank's side of a backend: its cache served to consumers."""

    @property
    def handshake_reply(self) -> HandshakeReply:
        """What a consumer connects with (served on the prefill side channel)."""

    def poll_releases(self) -> list[Release]:
        """Releases consumers sent since the last call, of this engine and epoch only."""

    def close(self) -> None: ...


class TransferBackend(Protocol):
    """One way of moving KV blocks: a factory of both roles."""

    name: str  # as configured (``kv_transfer_backend``) and carried in HandshakeReply.backend

    def producer(self, spec: ProducerSpec) -> KVProducerRole: ...

    def consumer(self, spec: CacheSpec) -> Puller:
        """The consumer role of one cache: pulls into it, releases producers."""


def release_of(handle: KVHandle, request_id: str, trace_id: str, rank: int) -> Release:
    """The release a consumer sends replica ``rank`` of ``handle`` once its READs are done."""
    return Release(
        request_id=request_id,
        trace_id=trace_id,
        engine_id=handle.engine_id,
        epoch=handle.epoch,
        rank=rank,
        token=handle.token,
    )


def backend_mismatch(reply: HandshakeReply, name: str) -> str | None:
    """The line refusing a producer of another backend; None when it is ``name``'s."""
    if reply.backend == name:
        return None
    return (
        f"transfer backend: this consumer speaks {name!r}, the producer {reply.backend!r}; "
        "run prefill and decode with the same kv_transfer_backend"
    )
