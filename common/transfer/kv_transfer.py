"""KV cache transfer by NIXL READ, the first transfer backend (common/transfer/backend.py;
its entry in common/transfer/nixl_backend.py): the producer (prefill rank) registers its
cache and answers a handshake; the consumer (decode rank, common/transfer/kv_consumer.py)
pulls blocks and releases them. This module has the producer and what both sides share:
``NixlHandshake``, the payload of a ``HandshakeReply`` only NIXL reads.

Descriptor count, not bandwidth, decides speed (FACTS.md), so:
- each side registers its whole cache once (a producer with a host tier its tier too, as
  DRAM: a handle's ``host_slots``), and the consumer prepares descriptor lists of
  (head, block) units once (its own at start, each remote's at connect, a remote's tier
  too; block-major caches also one of whole blocks), so a pull is one
  ``make_prepped_xfer`` call per memory kind over two index lists, no per-request list
  building (common/transfer/kv_descs.py);
- adjacent units coalesce: ``make_prepped_xfer`` merges index pairs whose local AND
  remote descriptors are both contiguous into one descriptor (NIXL's default merging; the
  tests check NIXL's own count in transfer telemetry): ``runs x heads`` descriptors per
  pull in head order, for any pair of TP sizes, ``runs`` in block order (common/engine/kv_layout.py).
  Measured against ``initialize_xfer`` with explicit run descriptors (64 MiB, 2-core CPU,
  CMA): same bytes/s for the same descriptors, but building the request took ~70-90 us
  prepped (flat in the number of runs) vs ~150 us (1 run) to ~1 ms (256 runs), because
  initialize_xfer re-validates and re-prepares both lists on every call.
NIXL agents are not thread-safe: use each KVProducer / KVConsumer from one thread only.

UCX environment: on CPU (DRAM) none is needed; UCX picks CMA zero-copy for GET between
processes of one host (needs ptrace permission between them: a hardened kernel setting,
yama ptrace_scope >= 1 across sibling processes, would break it). For GPU memory (VRAM)
without NVLink, UCX disables cuda_ipc GET and silently moves the data over TCP (0.55 vs
~2,000 GB/s on an H200), so ``UCX_CUDA_IPC_ENABLE_GET_ZCOPY=on`` is set, only if unset,
only for VRAM caches, before the agent's UCX context reads the environment.
"""

from __future__ import annotations

import os
from typing import Any

import msgspec
import structlog
import torch

from pdserve.common.engine.kv_cache import storage_of
from pdserve.common.engine.kv_layout import KVLayout
from pdserve.common.errors import PdserveError
from pdserve.common.parallel.tp import kv_heads_of
from pdserve.common.runtime.protocol import Decoder, HandshakeReply, Release
from pdserve.common.transfer.backend import ProducerSpec, backend_mismatch

log = structlog.get_logger("pdserve.kv_transfer")

# Fields that must agree for a block id to mean the same bytes on both sides (num_blocks,
# the pool size, may differ).
# num_kv_heads is per TP rank: checked against the TP mapping instead. The stored dtype and
# the fp8 scales are compared first, by kv_dtype_mismatch (a pull moves bytes, never converts).
LAYOUT_KEYS = ("num_layers", "block_size", "head_dim", "num_kv_parts")
# the --kv-cache-dtype that stores each dtype (uint8: an MLA latent in fp8_ds_mla records)
KV_DTYPE_NAMES = {"float8_e4m3fn": "fp8", "uint8": "fp8"}
_VRAM_UCX_ENV = {"UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "on"}
_release_decoder: Decoder[Release] = Decoder(Release)
NIXL = "nixl"  # the backend's name (HandshakeReply.backend, kv_transfer_backend)


class NixlHandshake(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, omit_defaults=True):
    """What a NIXL consumer needs of a producer rank beyond the shared handshake: its
    agent's metadata and where its cache is (``HandshakeReply.payload``, msgpack)."""

    agent_metadata: bytes
    base_address: int  # address of the registered KV cache tensor
    mem_type: str  # "DRAM" | "VRAM"
    device_id: int = 0
    # Its host tier (KVHandle.host_slots), registered as DRAM: the slots' address and
    # count (0: none; omitted then, so a consumer older than these fields still reads
    # the payload, and refuses one that names a tier). Slots are block-major.
    host_base_address: int = 0
    host_num_slots: int = 0


_handshake_decoder = msgspec.msgpack.Decoder(NixlHandshake)


def nixl_handshake(reply: HandshakeReply) -> NixlHandshake:
    """The NIXL part of a producer's handshake; KVTransferError for another backend's or a
    payload that is not NIXL's."""
    peer = peer_name(reply.engine_id, reply.epoch, reply.agent_name)
    mismatch = backend_mismatch(reply, NIXL)
    if mismatch is not None:
        raise KVTransferError(f"KV handshake with {peer} refused: {mismatch}")
    try:
        return _handshake_decoder.decode(reply.payload)
    except msgspec.DecodeError as exc:
        raise KVTransferError(f"KV handshake with {peer}: not a NIXL payload: {exc}") from exc


class KVTransferError(PdserveError):
    """A KV handshake, pull or release failed; the message names request, peer and cause."""


def peer_name(engine_id: str, epoch: int, agent_name: str) -> str:
    return f"agent {agent_name!r} (engine {engine_id!r} epoch {epoch})"


def _pull_error(request_id: str, peer: str, why: str) -> KVTransferError:
    return KVTransferError(f"KV pull of request {request_id!r} from {peer}: {why}")


def _kv_dtype(layout: KVLayout) -> str:
    flag = KV_DTYPE_NAMES.get(layout.dtype, "auto")
    scales = f", k_scale {layout.k_scale:g}, v_scale {layout.v_scale:g}" if layout.is_fp8 else ""
    stored = "uint8 fp8_ds_mla records" if layout.dtype == "uint8" else layout.dtype
    return f"{stored} (--kv-cache-dtype {flag}{scales})"


def kv_dtype_mismatch(local: KVLayout, remote: KVLayout) -> str | None:
    """The line refusing a producer whose stored KV dtype (or fp8 scales) differs, naming
    both; None when they agree."""
    if (local.dtype, local.k_scale, local.v_scale) == (
        remote.dtype,
        remote.k_scale,
        remote.v_scale,
    ):
        return None
    return (
        f"KV cache dtype: this decode stores {_kv_dtype(local)}, the producer "
        f"{_kv_dtype(remote)}; start prefill and decode with the same kv_cache_dtype"
    )


def incompatibilities(layout: KVLayout, compat: dict[str, Any], reply: HandshakeReply) -> list[str]:
    """One 'what: local=.. remote=..' line per difference; empty when compatible."""
    dtype_line = kv_dtype_mismatch(layout, reply.layout)
    diffs = [dtype_line] if dtype_line else []
    for key in sorted(set(compat) | set(reply.compat)):
        if key == "dtype" and dtype_line:
            continue  # the same difference, said above
        mine, theirs = compat.get(key, "<missing>"), reply.compat.get(key, "<missing>")
        if mine != theirs:
            diffs.append(f"compat[{key!r}]: local={mine!r} remote={theirs!r}")
    for key in LAYOUT_KEYS:
        mine, theirs = getattr(layout, key), getattr(reply.layout, key)
        if mine != theirs:
            diffs.append(f"layout.{key}: local={mine!r} remote={theirs!r}")
    total = reply.compat.get(
        "num_kv_heads", reply.layout.num_kv_heads if reply.tp_size == 1 else None
    )
    if isinstance(total, int) and total > 0 and 0 <= reply.tp_rank < reply.tp_size:
        expected = kv_heads_of(total, reply.tp_size, reply.tp_rank)[1]
        if reply.layout.num_kv_heads != expected:
            diffs.append(
                f"remote TP rank {reply.tp_rank}/{reply.tp_size} holds {reply.layout.num_kv_heads} "
                f"KV heads, but {total} KV heads over TP {reply.tp_size} give {expected}"
            )
    else:
        diffs.append(
            f"remote TP rank {reply.tp_rank}/{reply.tp_size} of a model with {total!r} KV heads "
            "cannot be mapped"
        )
    return diffs


def _memory_of(kv_cache: torch.Tensor) -> tuple[str, int]:
    """NIXL memory type and device id of a tensor (NIXL wants device 0 for DRAM)."""
    if kv_cache.device.type == "cpu":
        return "DRAM", 0
    return "VRAM", kv_cache.get_device()


def _check_cache(kv_cache: torch.Tensor, layout: KVLayout, who: str) -> None:
    # A mismatch would make every block offset wrong: refuse at start, not at the first read.
    dtype = str(kv_cache.dtype).removeprefix("torch.")
    if tuple(kv_cache.shape) != layout.shape or dtype != layout.dtype:
        raise KVTransferError(
            f"{who}: KV cache tensor {tuple(kv_cache.shape)} {dtype} does not match its layout "
            f"{layout.shape} {layout.dtype}"
        )
    if not storage_of(kv_cache, layout).is_contiguous():
        raise KVTransferError(
            f"{who}: KV cache must be a logical view of one {layout.order}-major "
            "storage tensor (engine/kv_cache.new_cache): one registration, runs contiguous"
        )


class _CacheAgent:
    """A NIXL agent (UCX backend) with one registration of a whole cache tensor."""

    def __init__(
        self,
        agent_name: str,
        kv_cache: torch.Tensor,
        layout: KVLayout,
        num_threads: int,
        capture_telemetry: bool = False,
    ) -> None:
        _check_cache(kv_cache, layout, f"agent {agent_name!r}")
        from nixl._api import nixl_agent, nixl_agent_config  # lazy: importing us needs no nixl

        self.agent_name = agent_name
        self.layout = layout
        self.kv_cache = kv_cache  # logical [num_blocks, num_layers, 2, H_kv, block_size, head_dim]
        self.mem_type, self.device_id = _memory_of(kv_cache)
        if self.mem_type == "VRAM":
            for key, value in _VRAM_UCX_ENV.items():
                os.environ.setdefault(key, value)
        # No progress thread: it spins (~25% of a core per agent while idle, measured on
        # the 2-core CI kind), and every agent is polled by its owner's loop anyway
        # (check_xfer_state / get_new_notifs drive progress).
        config = nixl_agent_config(
            enable_prog_thread=False,
            backends=["UCX"],
            num_threads=num_threads,
            capture_telemetry=capture_telemetry,
        )
        try:
            self._agent: Any = nixl_agent(agent_name, config)
            self._reg: Any = self._agent.register_memory(storage_of(kv_cache, layout))
        except Exception as exc:
            raise KVTransferError(f"agent {agent_name!r}: NIXL/UCX start failed: {exc!r}") from exc

    def _close_agent(self) -> None:
        if self._agent is None:
            return
        try:
            self._agent.deregister_memory(self._reg)
        except Exception as exc:  # noqa: BLE001 - closing must not fail (often at exit)
            log.warning("kv_deregister_failed", agent=self.agent_name, error=repr(exc))
        self._agent = None  # the C++ agent goes with its last reference


class KVProducer(_CacheAgent):
    """Prefill rank side: serves its cache to readers and collects their releases."""

    def __init__(
        self,
        *,
        engine_id: str,
        epoch: int,
        agent_name: str,
        kv_cache: torch.Tensor,
        layout: KVLayout,
        compat: dict[str, Any],
        num_threads: int = 0,
        tp_rank: int = 0,
        tp_size: int = 1,
        pcp_rank: int = 0,
        pcp_size: int = 1,
        host_cache: torch.Tensor | None = None,
        host_layout: KVLayout | None = None,
    ) -> None:
        super().__init__(agent_name, kv_cache, layout, num_threads)
        self.engine_id = engine_id
        self.epoch = epoch
        self.num_bad_notifications = 0
        self._host_reg: Any = None
        host_address = num_host_slots = 0
        if host_cache is not None and host_layout is not None:
            # registered once, as the cache is: a pull names slots by index
            _check_cache(host_cache, host_layout, f"agent {agent_name!r} host tier")
            try:
                self._host_reg = self._agent.register_memory(storage_of(host_cache, host_layout))
            except Exception as exc:
                self._close_agent()
                raise KVTransferError(
                    f"agent {agent_name!r}: registering the host tier failed: {exc!r}"
                ) from exc
            host_address, num_host_slots = host_cache.data_ptr(), host_layout.num_blocks
        spec = ProducerSpec(
            agent_name=agent_name,
            kv_cache=kv_cache,
            layout=layout,
            compat=compat,
            engine_id=engine_id,
            epoch=epoch,
            tp_rank=tp_rank,
            tp_size=tp_size,
            pcp_rank=pcp_rank,
            pcp_size=pcp_size,
        )
        payload = NixlHandshake(
            agent_metadata=self._agent.get_agent_metadata(),
            base_address=kv_cache.data_ptr(),
            mem_type=self.mem_type,
            device_id=self.device_id,
            host_base_address=host_address,
            host_num_slots=num_host_slots,
        )
        self._reply = spec.reply(NIXL, msgspec.msgpack.encode(payload))

    @property
    def handshake_reply(self) -> HandshakeReply:
        return self._reply

    def poll_releases(self) -> list[Release]:
        """Releases received as NIXL notifications since the last call. Anything that is
        not a Release of this engine and epoch is counted and logged, never raised: a bad
        peer must not take the producer down."""
        try:
            notifs: dict[str, list[bytes]] = self._agent.get_new_notifs()
        except Exception as exc:
            raise KVTransferError(
                f"{peer_name(self.engine_id, self.epoch, self.agent_name)}: "
                f"reading NIXL notifications failed: {exc!r}"
            ) from exc
        releases = []
        for sender, messages in notifs.items():
            for raw in messages:
                release, why = self._decode(raw)
                if release is not None:
                    releases.append(release)
                    continue
                self.num_bad_notifications += 1
                log.warning(
                    "kv_bad_notification",
                    agent=self.agent_name,
                    engine_id=self.engine_id,
                    epoch=self.epoch,
                    sender=sender,
                    size=len(raw),
                    reason=why,
                )
        return releases

    def _decode(self, raw: bytes) -> tuple[Release | None, str]:
        try:
            release = _release_decoder.decode(raw)
        except msgspec.DecodeError as exc:
            return None, f"not a Release: {exc}"
        if release.engine_id != self.engine_id or release.epoch != self.epoch:
            # A release meant for another life of this engine must not free our blocks.
            return None, (
                f"release of {release.request_id!r} for engine {release.engine_id!r} "
                f"epoch {release.epoch}"
            )
        return release, ""

    def close(self) -> None:
        if self._host_reg is not None and self._agent is not None:
            try:
                self._agent.deregister_memory(self._host_reg)
            except Exception as exc:  # noqa: BLE001 - closing must not fail (often at exit)
                log.warning("kv_deregister_failed", agent=self.agent_name, error=repr(exc))
            self._host_reg = None
        self._close_agent()
