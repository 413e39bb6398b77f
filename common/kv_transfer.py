"""KV cache transfer by NIXL READ: the producer (prefill rank) registers its cache and
answers a handshake; the consumer (decode rank) pulls blocks and releases them.

Descriptor count, not bandwidth, decides speed (FACTS.md), so:
- each side registers its whole cache once, and the consumer prepares (head, block)-
  granular descriptor lists once (its own at start, each remote's at connect), so any
  (head, block) is an index ``head * num_blocks + block`` and a pull is one
  ``make_prepped_xfer`` call, no per-request list building;
- adjacent blocks coalesce: the layout is head-major (common/kv_layout.py), so for one
  head a run of blocks is contiguous on both sides, and ``make_prepped_xfer`` merges index
  pairs whose local AND remote descriptors are both contiguous into one descriptor
  (NIXL's default descriptor merging; the tests check NIXL's own count in transfer
  telemetry): ``runs x heads`` descriptors per pull, for any pair of TP sizes. Measured
  against ``initialize_xfer`` with explicit run descriptors (64 MiB,
  2-core CPU, CMA): same bytes/s for the same descriptors, but building the request took
  ~70-90 us prepped (flat in the number of runs) vs ~150 us (1 run) to ~1 ms (256 runs),
  because initialize_xfer re-validates and re-prepares both lists on every call.
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
import time
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np
import structlog
import torch

from pdserve.common.errors import PdserveError
from pdserve.common.kv_layout import KVLayout
from pdserve.common.tp import kv_heads_of
from pdserve.common.protocol import Decoder, HandshakeReply, KVHandle, Release, encode

log = structlog.get_logger("pdserve.kv_transfer")

# Fields that must agree for a block id to mean the same bytes on both sides (num_blocks,
# the pool size, may differ).
# num_kv_heads is per TP rank: checked against the TP mapping instead.
LAYOUT_KEYS = ("num_layers", "block_size", "head_dim", "dtype")
_VRAM_UCX_ENV = {"UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "on"}
_release_decoder: Decoder[Release] = Decoder(Release)


class KVTransferError(PdserveError):
    """A KV handshake, pull or release failed; the message names request, peer and cause."""


def peer_name(engine_id: str, epoch: int, agent_name: str) -> str:
    return f"agent {agent_name!r} (engine {engine_id!r} epoch {epoch})"


def _pull_error(request_id: str, peer: str, why: str) -> KVTransferError:
    return KVTransferError(f"KV pull of request {request_id!r} from {peer}: {why}")


def coalesce(remote_ids: list[int], local_ids: list[int]) -> list[tuple[int, int, int]]:
    """Runs (remote_first, local_first, count) where both sides' ids are consecutive:
    each run is one descriptor of count * block_bytes."""
    runs: list[tuple[int, int, int]] = []
    for r, lo in zip(remote_ids, local_ids, strict=True):
        if runs:
            rf, lf, n = runs[-1]
            if rf + n == r and lf + n == lo:
                runs[-1] = (rf, lf, n + 1)
                continue
        runs.append((r, lo, 1))
    return runs


def incompatibilities(
    layout: KVLayout, compat: dict[str, Any], reply: HandshakeReply
) -> list[str]:
    """One 'what: local=.. remote=..' line per difference; empty when compatible."""
    diffs = []
    for key in sorted(set(compat) | set(reply.compat)):
        mine, theirs = compat.get(key, "<missing>"), reply.compat.get(key, "<missing>")
        if mine != theirs:
            diffs.append(f"compat[{key!r}]: local={mine!r} remote={theirs!r}")
    for key in LAYOUT_KEYS:
        mine, theirs = getattr(layout, key), getattr(reply.layout, key)
        if mine != theirs:
            diffs.append(f"layout.{key}: local={mine!r} remote={theirs!r}")
    total = reply.compat.get("num_kv_heads", reply.layout.num_kv_heads if reply.tp_size == 1 else None)
    if isinstance(total, int) and total > 0 and 0 <= reply.tp_rank < reply.tp_size:
        expected = kv_heads_of(total, reply.tp_size, reply.tp_rank)[1]
        if reply.layout.num_kv_heads != expected:
            diffs.append(f"remote TP rank {reply.tp_rank}/{reply.tp_size} holds {reply.layout.num_kv_heads} "
                         f"KV heads, but {total} KV heads over TP {reply.tp_size} give {expected}")
    else:
        diffs.append(f"remote TP rank {reply.tp_rank}/{reply.tp_size} of a model with {total!r} KV heads "
                     "cannot be mapped")
    return diffs


def new_cache(layout: KVLayout, device: torch.device | str = "cpu") -> torch.Tensor:
    """A zeroed cache in our memory order, returned as its logical view [N, L, 2, H, B, D]."""
    storage = torch.zeros(layout.storage_shape, dtype=getattr(torch, layout.dtype), device=device)
    return storage.permute(layout.logical_from_storage)


def storage_of(kv_cache: torch.Tensor, layout: KVLayout) -> torch.Tensor:
    """The memory-order tensor ([H, N, ...] or [N, H, ...]) behind a logical cache view."""
    return kv_cache.permute(layout.storage_from_logical)


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
        raise KVTransferError(f"{who}: KV cache must be a logical view of one {layout.order}-major "
                              "storage tensor (kv_transfer.new_cache): one registration, runs contiguous")


def _head_block_descs(base: int, layout: KVLayout, device_id: int) -> np.ndarray:
    """[H * N, 3] (address, length, device) rows, one per (head, block) unit in memory
    order: row ``layout.unit_index(head, block)``."""
    count = layout.num_kv_heads * layout.num_blocks
    descs = np.empty((count, 3), dtype=np.uint64)
    descs[:, 0] = base + np.arange(count, dtype=np.uint64) * layout.head_block_bytes
    descs[:, 1] = layout.head_block_bytes
    descs[:, 2] = device_id
    return descs


def _block_descs(base: int, layout: KVLayout, device_id: int) -> np.ndarray | None:
    """Block order only: [N, 3] rows, one per block with all its heads (row = block id)."""
    if layout.order != "block":
        return None
    descs = np.empty((layout.num_blocks, 3), dtype=np.uint64)
    descs[:, 0] = base + np.arange(layout.num_blocks, dtype=np.uint64) * layout.block_bytes
    descs[:, 1] = layout.block_bytes
    descs[:, 2] = device_id
    return descs


def _num_runs(remote_idx: np.ndarray, local_idx: np.ndarray) -> int:
    """Descriptors after merging: index pairs where both sides step by exactly one continue a run."""
    if not len(local_idx):
        return 0
    cont = (remote_idx[1:] - remote_idx[:-1] == 1) & (local_idx[1:] - local_idx[:-1] == 1)
    return int(len(local_idx) - np.count_nonzero(cont))


def _indices(ids: np.ndarray, layout: KVLayout, first_head: int, num_heads: int, by_block: bool) -> np.ndarray:
    """Unit indices (KVLayout.unit_index) of heads [first_head, +num_heads) of blocks ``ids``,
    enumerated block by block (``by_block``) or head by head. Both sides of a READ must use
    one enumeration, as NIXL pairs the two index lists element by element."""
    heads = np.arange(first_head, first_head + num_heads, dtype=np.int32)
    if layout.order == "block":
        units = ids[:, None] * layout.num_kv_heads + heads[None, :]  # [blocks, heads]
    else:
        units = (heads[:, None] * layout.num_blocks + ids[None, :]).T  # [blocks, heads]
    return (units if by_block else units.T).ravel()


class _CacheAgent:
    """A NIXL agent (UCX backend) with one registration of a whole cache tensor."""

    def __init__(
        self, agent_name: str, kv_cache: torch.Tensor, layout: KVLayout,
        num_threads: int, capture_telemetry: bool = False,
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
        config = nixl_agent_config(enable_prog_thread=False, backends=["UCX"], num_threads=num_threads,
                                   capture_telemetry=capture_telemetry)
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
        self, *, engine_id: str, epoch: int, agent_name: str, kv_cache: torch.Tensor,
        layout: KVLayout, compat: dict[str, Any], num_threads: int = 0,
        tp_rank: int = 0, tp_size: int = 1, pcp_rank: int = 0, pcp_size: int = 1,
    ) -> None:
        super().__init__(agent_name, kv_cache, layout, num_threads)
        self.engine_id = engine_id
        self.epoch = epoch
        self.num_bad_notifications = 0
        self._reply = HandshakeReply(
            engine_id=engine_id, epoch=epoch, agent_name=agent_name,
            agent_metadata=self._agent.get_agent_metadata(), base_address=kv_cache.data_ptr(),
            layout=layout, compat=dict(compat), mem_type=self.mem_type, device_id=self.device_id,
            tp_rank=tp_rank, tp_size=tp_size, pcp_rank=pcp_rank, pcp_size=pcp_size,
        )

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
                log.warning("kv_bad_notification", agent=self.agent_name, engine_id=self.engine_id,
                            epoch=self.epoch, sender=sender, size=len(raw), reason=why)
        return releases

    def _decode(self, raw: bytes) -> tuple[Release | None, str]:
        try:
            release = _release_decoder.decode(raw)
        except msgspec.DecodeError as exc:
            return None, f"not a Release: {exc}"
        if release.engine_id != self.engine_id or release.epoch != self.epoch:
            # A release meant for another life of this engine must not free our blocks.
            return None, (f"release of {release.request_id!r} for engine {release.engine_id!r} "
                          f"epoch {release.epoch}")
        return release, ""

    def close(self) -> None:
        self._close_agent()


@dataclass(eq=False)
class Pull:
    """One posted READ of a request's blocks from one replica."""

    request_id: str
    peer: str  # for messages: agent, engine, epoch
    num_descriptors: int  # coalesced runs
    num_bytes: int
    started_at: float  # time.perf_counter() before building the request
    # On CPU, UCX's CMA GET copies inside transfer(): posting then ~ the whole transfer.
    posted_at: float = 0.0
    done_at: float | None = None
    nixl_descriptors: int | None = None  # NIXL's own count (only with capture_telemetry)
    error: str | None = None
    remote: Any = field(default=None, repr=False)  # the _Remote read from
    xfer: Any = field(default=None, repr=False)

    @property
    def done(self) -> bool:
        return self.done_at is not None

    @property
    def post_seconds(self) -> float:
        return self.posted_at - self.started_at

    @property
    def transfer_seconds(self) -> float | None:
        return None if self.done_at is None else self.done_at - self.started_at


@dataclass(eq=False)
class _Remote:
    reply: HandshakeReply
    dlist: Any  # prepped (head, block)-granular descriptor list of the remote cache
    blocks: Any = None  # block order: prepped list of whole blocks (all heads), else None
    failed: bool = False  # a READ from it failed: releases take the side channel


class KVConsumer(_CacheAgent):
    """Decode rank side: connects to producer replicas, pulls blocks, releases them."""

    def __init__(
        self, *, agent_name: str, kv_cache: torch.Tensor, layout: KVLayout,
        compat: dict[str, Any], num_threads: int = 0, capture_telemetry: bool = False,
    ) -> None:
        super().__init__(agent_name, kv_cache, layout, num_threads, capture_telemetry)
        self.compat = dict(compat)
        self._telemetry = capture_telemetry
        # Local list prepared once for every remote: it only names our own memory.
        descs = _head_block_descs(kv_cache.data_ptr(), layout, self.device_id)
        self._local_dlist: Any = self._agent.prep_xfer_dlist(
            "NIXL_INIT_AGENT", descs, self.mem_type
        )
        # Block order: whole blocks too, so that a pull of every head between two
        # block-major caches indexes by block id alone (no per-head index arrays).
        blocks = _block_descs(kv_cache.data_ptr(), layout, self.device_id)
        self._local_blocks: Any = (None if blocks is None
                                   else self._agent.prep_xfer_dlist("NIXL_INIT_AGENT", blocks, self.mem_type))
        self._remotes: dict[tuple[str, int, str], _Remote] = {}  # (engine, epoch, agent)
        # Releases go out from a second agent (no memory, no READs). Sent from the reading
        # agent, a notification sits on the same UCX endpoint as the next READ, whose
        # completion then waits until the producer's agent has made progress: measured
        # 943-950 ms per 32 MiB pull against a producer progressing once a second, 6-12 ms
        # with this notifier (cli/bench_transfer.py --producer-poll-ms).
        from nixl._api import nixl_agent, nixl_agent_config

        try:
            self._notifier: Any = nixl_agent(f"{agent_name}-notify",
                                             nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
        except Exception as exc:
            raise KVTransferError(f"agent {agent_name!r}: NIXL/UCX notifier start failed: {exc!r}") from exc

    # -- handshake ------------------------------------------------------------------------

    def connect(self, reply: HandshakeReply) -> None:
        """Load one producer replica's agent and prepare its descriptor list. Idempotent;
        a newer epoch of an engine replaces the older one (whose handles are then refused)."""
        key = (reply.engine_id, reply.epoch, reply.agent_name)
        self._check_handshake(reply)
        if key in self._remotes:
            return
        related = [k for k in self._remotes if k[0] == reply.engine_id or k[2] == reply.agent_name]
        for old in related:
            if old[0] != reply.engine_id or old[1] < reply.epoch:  # restarted, or name reused
                log.info("kv_remote_replaced", old=peer_name(*old), new=peer_name(*key))
                self._drop(old)
        try:
            name = self._agent.add_remote_agent(reply.agent_metadata)
        except Exception as exc:
            raise KVTransferError(f"KV handshake with {peer_name(*key)}: loading its NIXL "
                                  f"metadata failed: {exc!r}") from exc
        name = name.decode() if isinstance(name, bytes) else name
        try:
            if name != reply.agent_name:
                raise ValueError(f"its metadata names agent {name!r}")
            descs = _head_block_descs(reply.base_address, reply.layout, reply.device_id)
            dlist = self._agent.prep_xfer_dlist(name, descs, reply.mem_type)
            blocks = _block_descs(reply.base_address, reply.layout, reply.device_id)
            block_dlist = None if blocks is None else self._agent.prep_xfer_dlist(name, blocks, reply.mem_type)
            self._notifier.add_remote_agent(reply.agent_metadata)
        except Exception as exc:
            self._agent.remove_remote_agent(name)
            raise KVTransferError(f"KV handshake with {peer_name(*key)}: {exc}") from exc
        self._remotes[key] = _Remote(reply=reply, dlist=dlist, blocks=block_dlist)
        log.info("kv_remote_connected", peer=peer_name(*key), mem_type=reply.mem_type,
                 num_blocks=reply.layout.num_blocks)

    def _check_handshake(self, reply: HandshakeReply) -> None:
        what = (f"KV handshake of {self.agent_name!r} with "
                f"{peer_name(reply.engine_id, reply.epoch, reply.agent_name)} refused")
        diffs = incompatibilities(self.layout, self.compat, reply)
        if diffs:
            raise KVTransferError(f"{what}: incompatible " + "; ".join(diffs))
        newer = [k[1] for k in self._remotes if k[0] == reply.engine_id and k[1] > reply.epoch]
        if newer:
            raise KVTransferError(f"{what}: stale epoch, epoch {max(newer)} is connected")

    def is_connected(self, engine_id: str, epoch: int, agent_name: str | None = None) -> bool:
        return any(
            k[:2] == (engine_id, epoch) and agent_name in (None, k[2]) for k in self._remotes
        )

    def disconnect(self, engine_id: str, epoch: int) -> None:
        """Forget every replica of one engine epoch (abort its pulls first)."""
        for key in [k for k in self._remotes if k[0] == engine_id and k[1] == epoch]:
            self._drop(key)

    def _drop(self, key: tuple[str, int, str]) -> None:
        remote = self._remotes.pop(key)
        for step in (remote.dlist.release, lambda: remote.blocks is not None and remote.blocks.release(), lambda: self._agent.remove_remote_agent(key[2]),
                     lambda: self._notifier.remove_remote_agent(key[2])):
            try:
                step()
            except Exception as exc:  # noqa: BLE001 - the remote may be gone; forget it anyway
                log.warning("kv_remote_drop_failed", peer=peer_name(*key), error=repr(exc))

    def _remote_for(self, handle: KVHandle, replica: int, request_id: str) -> _Remote:
        if not 0 <= replica < len(handle.replicas):
            raise KVTransferError(
                f"KV pull of request {request_id!r}: replica {replica} out of range, handle of "
                f"engine {handle.engine_id!r} epoch {handle.epoch} has {len(handle.replicas)}"
            )
        agent = handle.replicas[replica].agent_name
        remote = self._remotes.get((handle.engine_id, handle.epoch, agent))
        if remote is not None:
            return remote
        peer = peer_name(handle.engine_id, handle.epoch, agent)
        epochs = sorted({k[1] for k in self._remotes if k[0] == handle.engine_id})
        why = f"stale epoch (connected: {epochs})" if epochs else "not connected (no handshake)"
        raise _pull_error(request_id, peer, f"refused, {why}")

    # -- pulls ----------------------------------------------------------------------------

    def start_pull(
        self, request_id: str, handle: KVHandle, local_block_ids: list[int], replica: int = 0,
        heads: list[tuple[int, int, int]] | None = None,
    ) -> Pull:
        """Post a READ of handle.block_ids (on replica ``replica``) into local_block_ids.

        ``heads``: (remote first head, local first head, count) slices of the remote
        rank's KV heads to read (tp.pull_plan); None reads every head into the same one."""
        started = time.perf_counter()
        remote = self._remote_for(handle, replica, request_id)
        peer = peer_name(handle.engine_id, handle.epoch, remote.reply.agent_name)
        try:
            local_ids = np.array(local_block_ids, dtype=np.int64)
            remote_ids = np.array(handle.block_ids, dtype=np.int64)
        except (OverflowError, ValueError, TypeError) as exc:
            raise _pull_error(request_id, peer, f"refused, block ids are not block numbers: {exc}") from exc
        self._check_ids(request_id, peer, handle, remote, local_ids, remote_ids)
        local_ids, remote_ids = local_ids.astype(np.int32), remote_ids.astype(np.int32)  # in range now
        rlayout = remote.reply.layout
        if heads is None:
            heads = [(0, 0, self.layout.num_kv_heads)]
        self._check_heads(request_id, peer, remote, heads)
        num_heads = sum(n for _, _, n in heads)
        if remote.blocks is not None and self._local_blocks is not None and heads == [(0, 0, rlayout.num_kv_heads)] \
                and rlayout.num_kv_heads == self.layout.num_kv_heads:
            # Every head, both caches block-major: whole blocks, indexed by block id.
            local_list, remote_list, local_idx, remote_idx = self._local_blocks, remote.blocks, local_ids, remote_ids
        else:
            # (head, block) units; NIXL merges pairs contiguous on both sides into one
            # descriptor: one per head and run of blocks (fewer when runs meet across
            # heads). Enumerated so that units adjacent in memory on both sides are
            # adjacent in the lists: block by block when both are block-major, else
            # head by head.
            by_block = self.layout.order == rlayout.order == "block"
            local_list, remote_list = self._local_dlist, remote.dlist
            local_idx = np.concatenate([_indices(local_ids, self.layout, dst, n, by_block) for _, dst, n in heads])
            remote_idx = np.concatenate([_indices(remote_ids, rlayout, src, n, by_block) for src, _, n in heads])
        pull = Pull(request_id=request_id, peer=peer, remote=remote, num_descriptors=0,
                    num_bytes=len(local_ids) * num_heads * self.layout.head_block_bytes,
                    started_at=started)
        if not len(local_idx):  # NIXL refuses an empty request: done at once
            pull.posted_at = pull.done_at = time.perf_counter()
            return pull
        try:
            pull.xfer = self._agent.make_prepped_xfer(
                "READ", local_list, local_idx, remote_list, remote_idx,
            )
            state = self._agent.transfer(pull.xfer)
        except Exception as exc:
            self._finish(pull, f"posting the READ failed: {exc!r}")
            raise _pull_error(request_id, peer, pull.error or "") from exc
        pull.posted_at = time.perf_counter()
        if state == "ERR":
            self._finish(pull, "posting the READ failed: NIXL state ERR")
            raise _pull_error(request_id, peer, pull.error or "")
        pull.num_descriptors = _num_runs(remote_idx, local_idx)  # counted while the READ runs
        return pull

    def _check_ids(
        self, request_id: str, peer: str, handle: KVHandle, remote: _Remote, local: np.ndarray,
        remote_ids: np.ndarray,
    ) -> None:
        # Refused before posting: NIXL would reject the indices, but say which ones and why.
        if handle.layout != remote.reply.layout:
            why = f"handle layout {handle.layout} differs from the handshake's"
            raise _pull_error(request_id, peer, f"refused, {why}")
        if len(handle.block_ids) != len(local):
            why = f"{len(handle.block_ids)} remote blocks but {len(local)} local"
            raise _pull_error(request_id, peer, f"refused, {why}")
        for side, ids, n in (("remote", remote_ids, remote.reply.layout.num_blocks),
                             ("local", local, self.layout.num_blocks)):
            if len(ids) and (ids.min() < 0 or ids.max() >= n):  # C-speed check; list only on error
                bad = [int(b) for b in ids if not 0 <= b < n][:8]
                why = f"{side} block ids {bad} outside [0, {n})"
                raise _pull_error(request_id, peer, f"refused, {why}")

    def _check_heads(self, request_id: str, peer: str, remote: _Remote, heads: list[tuple[int, int, int]]) -> None:
        for src, dst, n in heads:
            if n < 0 or src < 0 or dst < 0 or src + n > remote.reply.layout.num_kv_heads or dst + n > self.layout.num_kv_heads:
                why = (f"head slice (remote {src}, local {dst}, count {n}) outside remote "
                       f"{remote.reply.layout.num_kv_heads} / local {self.layout.num_kv_heads} KV heads")
                raise _pull_error(request_id, peer, f"refused, {why}")

    def poll(self, pull: Pull) -> bool:
        """True when the pull is done, False while in progress; raises on failure."""
        if pull.error is not None:
            raise _pull_error(pull.request_id, pull.peer, pull.error or "")
        if pull.done:
            return True
        try:
            state = self._agent.check_xfer_state(pull.xfer)
        except Exception as exc:  # noqa: BLE001
            state = f"ERR ({exc!r})"
        if state == "PROC":
            return False
        if state == "DONE":
            pull.done_at = time.perf_counter()
            if self._telemetry:
                pull.nixl_descriptors = self._agent.get_xfer_telemetry(pull.xfer).descCount
            self._finish(pull, None)
            return True
        self._finish(pull, f"transfer failed: NIXL state {state}")
        raise _pull_error(pull.request_id, pull.peer, pull.error or "")

    def abort(self, pull: Pull) -> None:
        """Give up on a pull (timeout, request aborted): NIXL cancels it if still running."""
        if pull.xfer is not None:
            self._finish(pull, pull.error or "aborted")

    def _finish(self, pull: Pull, error: str | None) -> None:
        pull.error = error
        if error is not None and error != "aborted" and pull.remote is not None:
            pull.remote.failed = True
        xfer, pull.xfer = pull.xfer, None
        if xfer is not None:
            try:
                xfer.release()
            except Exception as exc:  # noqa: BLE001 - NIXL keeps it and retries at agent teardown
                log.warning("kv_xfer_release_failed", request_id=pull.request_id, peer=pull.peer,
                            error=repr(exc))

    # -- releases -------------------------------------------------------------------------

    def release(self, handle: KVHandle, request_id: str, trace_id: str = "") -> list[int]:
        """Notify EVERY replica (read from or not) that the request's blocks may be freed.
        Returns the replica indices not notified: the caller falls back to the side channel."""
        failed = []
        for index, replica in enumerate(handle.replicas):
            message = encode(Release(request_id=request_id, trace_id=trace_id,
                                     engine_id=handle.engine_id, epoch=handle.epoch, rank=index))
            key = (handle.engine_id, handle.epoch, replica.agent_name)
            try:
                if key not in self._remotes:
                    raise KVTransferError("not connected")
                if self._remotes[key].failed:
                    raise KVTransferError("a READ from it failed")
                self._notifier.send_notif(replica.agent_name, message)
            except Exception as exc:  # noqa: BLE001
                failed.append(index)
                log.warning("kv_release_notification_failed", request_id=request_id,
                            trace_id=trace_id, peer=peer_name(*key), error=repr(exc))
        return failed

    def progress(self) -> None:
        """Drive UCX. Agents run without a progress thread (it spins: ~25% of a core per
        idle agent on the 2-core CI kind), so the owner's loop calls this every
        iteration, idle or not, for queued release notifications to go out."""
        for agent in (self._agent, self._notifier):
            for sender, messages in agent.get_new_notifs().items():
                log.warning("kv_unexpected_notification", agent=self.agent_name, sender=sender, count=len(messages))

    def close(self) -> None:
        if self._agent is None:
            return
        # Let UCX finish (or fail) what is queued, notifications to a dead peer included:
        # an endpoint destroyed with operations still queued can abort the process
        # (ucs_arbiter assertion, seen 1 run in 7 after tests/test_kv_transfer.py's crash).
        for _ in range(3):
            try:
                self.progress()
            except Exception:  # noqa: BLE001 - closing must not fail
                break
        for key in list(self._remotes):
            self._drop(key)
        try:
            self._local_dlist.release()
            if self._local_blocks is not None:
                self._local_blocks.release()
        except Exception as exc:  # noqa: BLE001
            log.warning("kv_dlist_release_failed", agent=self.agent_name, error=repr(exc))
        self._notifier = None
        self._close_agent()
