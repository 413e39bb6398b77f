"""The decode side of KV transfer: ``KVConsumer`` connects to producer replicas, pulls
blocks with NIXL READs and releases them (common/transfer/kv_transfer.py has the producer
and the shared parts; common/transfer/kv_descs.py the descriptor arithmetic;
common/transfer/kv_pull_state.py ``Pull``, ``Remote`` and the checks before a READ is
posted).

NIXL agents are not thread-safe: use each KVConsumer from one thread only.
"""

from __future__ import annotations

import time
from typing import Any

import msgspec
import numpy as np
import structlog
import torch

from pdserve.common.engine.kv_layout import KVLayout
from pdserve.common.runtime.protocol import HandshakeReply, KVHandle, encode
from pdserve.common.runtime.sd_notify import before_wait
from pdserve.common.transfer.backend import release_of
from pdserve.common.transfer.kv_descs import block_descs, head_block_descs, num_runs, unit_indices
from pdserve.common.transfer.kv_pull_state import Pull, Remote, check_heads, check_ids
from pdserve.common.transfer.kv_transfer import (
    KVTransferError,
    NixlHandshake,
    _CacheAgent,
    _pull_error,
    incompatibilities,
    nixl_handshake,
    peer_name,
)

log = structlog.get_logger("pdserve.kv_transfer")
# A producer a READ failed from (unreachable: a partition) is reconnected after this long,
# doubling after each failed try up to RECONNECT_MAX_SECONDS: a try blocks the pulling
# thread for UCX's connect timeout (~1.3 s on TCP) while the producer stays unreachable.
RECONNECT_SECONDS = 2.0
RECONNECT_MAX_SECONDS = 30.0


class KVConsumer(_CacheAgent):
    """Decode rank side: connects to producer replicas, pulls blocks, releases them."""

    def __init__(
        self,
        *,
        agent_name: str,
        kv_cache: torch.Tensor,
        layout: KVLayout,
        compat: dict[str, Any],
        num_threads: int = 0,
        capture_telemetry: bool = False,
    ) -> None:
        super().__init__(agent_name, kv_cache, layout, num_threads, capture_telemetry)
        self.compat = dict(compat)
        self._telemetry = capture_telemetry
        # Local list prepared once for every remote: it only names our own memory.
        descs = head_block_descs(kv_cache.data_ptr(), layout, self.device_id)
        self._local_dlist: Any = self._agent.prep_xfer_dlist(
            "NIXL_INIT_AGENT", descs, self.mem_type
        )
        # Block order: whole blocks too, so that a pull of every head between two
        # block-major caches indexes by block id alone (no per-head index arrays).
        blocks = block_descs(kv_cache.data_ptr(), layout, self.device_id)
        self._local_blocks: Any = (
            None
            if blocks is None
            else self._agent.prep_xfer_dlist("NIXL_INIT_AGENT", blocks, self.mem_type)
        )
        self._remotes: dict[tuple[str, int, str], Remote] = {}  # (engine, epoch, agent)
        # Remotes dropped after a failed READ: (their handshake, next try, the wait after it)
        self._lost: dict[tuple[str, int, str], tuple[HandshakeReply, float, float]] = {}
        # Releases go out from a second agent (no memory, no READs). Sent from the reading
        # agent, a notification sits on the same UCX endpoint as the next READ, whose
        # completion then waits until the producer's agent has made progress: measured
        # 943-950 ms per 32 MiB pull against a producer progressing once a second, 6-12 ms
        # with this notifier (cli/bench/bench_transfer.py --producer-poll-ms).
        from nixl._api import nixl_agent, nixl_agent_config

        try:
            self._notifier: Any = nixl_agent(
                f"{agent_name}-notify",
                nixl_agent_config(enable_prog_thread=False, backends=["UCX"]),
            )
        except Exception as exc:
            raise KVTransferError(
                f"agent {agent_name!r}: NIXL/UCX notifier start failed: {exc!r}"
            ) from exc

    # -- handshake ------------------------------------------------------------------------

    def connect(self, reply: HandshakeReply) -> None:
        """Load one producer replica's agent and prepare its descriptor list. Idempotent;
        a newer epoch of an engine replaces the older one (whose handles are then refused).
        A replica a READ failed from (none posted now) or dropped since is loaded again
        at once: the decode's side channel reached the producer again (connect ahead)."""
        key = (reply.engine_id, reply.epoch, reply.agent_name)
        nixl = nixl_handshake(reply)
        self._check_handshake(reply)
        known = self._remotes.get(key)
        if known is not None and not (known.failed and not known.num_posted):
            return
        if known is not None:  # lost until the load below works (a pull then retries it)
            self._drop(key)
            self._lost[key] = (known.reply, time.monotonic() + RECONNECT_SECONDS, RECONNECT_SECONDS)
        related = [k for k in self._remotes if k[0] == reply.engine_id or k[2] == reply.agent_name]
        for old in related:
            if old[0] != reply.engine_id or old[1] < reply.epoch:  # restarted, or name reused
                log.info("kv_remote_replaced", old=peer_name(*old), new=peer_name(*key))
                self._drop(old)
        # Loading connects: an unreachable producer holds this thread for UCX's connect
        # timeout, which must count from a fresh watchdog ping (sd_notify.before_wait).
        before_wait()
        try:
            name = self._agent.add_remote_agent(nixl.agent_metadata)
        except Exception as exc:
            raise KVTransferError(
                f"KV handshake with {peer_name(*key)}: loading its NIXL metadata failed: {exc!r}"
            ) from exc
        name = name.decode() if isinstance(name, bytes) else name
        try:
            if name != reply.agent_name:
                raise ValueError(f"its metadata names agent {name!r}")
            descs = head_block_descs(nixl.base_address, reply.layout, nixl.device_id)
            dlist = self._agent.prep_xfer_dlist(name, descs, nixl.mem_type)
            blocks = block_descs(nixl.base_address, reply.layout, nixl.device_id)
            block_dlist = (
                None if blocks is None else self._agent.prep_xfer_dlist(name, blocks, nixl.mem_type)
            )
            remote = Remote(reply=reply, dlist=dlist, blocks=block_dlist)
            if nixl.host_num_slots:
                self._prep_host_tier(remote, name, nixl)
            self._notifier.add_remote_agent(nixl.agent_metadata)
        except Exception as exc:
            self._agent.remove_remote_agent(name)
            raise KVTransferError(f"KV handshake with {peer_name(*key)}: {exc}") from exc
        self._remotes[key] = remote
        self._lost.pop(key, None)
        log.info(
            "kv_remote_connected",
            peer=peer_name(*key),
            mem_type=nixl.mem_type,
            num_blocks=reply.layout.num_blocks,
        )

    def _prep_host_tier(self, remote: Remote, name: str, nixl: NixlHandshake) -> None:
        """The producer's host tier as a second remote cache: DRAM, block-major, its own
        slot count (common/engine/tier_buffer.py lays it out so)."""
        layout = msgspec.structs.replace(
            remote.reply.layout, num_blocks=nixl.host_num_slots, order="block"
        )
        units = head_block_descs(nixl.host_base_address, layout, 0)
        remote.host_dlist = self._agent.prep_xfer_dlist(name, units, "DRAM")
        blocks = block_descs(nixl.host_base_address, layout, 0)
        remote.host_blocks = self._agent.prep_xfer_dlist(name, blocks, "DRAM")
        remote.host_layout = layout

    def _check_handshake(self, reply: HandshakeReply) -> None:
        what = (
            f"KV handshake of {self.agent_name!r} with "
            f"{peer_name(reply.engine_id, reply.epoch, reply.agent_name)} refused"
        )
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
        for key in [k for k in self._lost if k[0] == engine_id and k[1] == epoch]:
            del self._lost[key]

    def _drop(self, key: tuple[str, int, str]) -> None:
        remote = self._remotes.pop(key)
        for step in (
            remote.dlist.release,
            lambda: remote.blocks is not None and remote.blocks.release(),
            lambda: remote.host_dlist is not None and remote.host_dlist.release(),
            lambda: remote.host_blocks is not None and remote.host_blocks.release(),
            lambda: self._agent.remove_remote_agent(key[2]),
            lambda: self._notifier.remove_remote_agent(key[2]),
        ):
            try:
                step()
            except Exception as exc:  # noqa: BLE001 - the remote may be gone; forget it anyway
                log.warning("kv_remote_drop_failed", peer=peer_name(*key), error=repr(exc))

    def _reconnect(self, key: tuple[str, int, str], request_id: str) -> Remote:
        """A READ from this remote failed (UCX closed its endpoint: a partition, a reset) and
        none is posted now: load its metadata again, so that a producer which is reachable
        again (a partition healed) serves without a restart. Its epoch is unchanged: the
        blocks of its handles are the ones it still holds under their leases. While the
        producer is unreachable the load fails (after UCX's connect timeout, on this
        thread): tried again at a pull RECONNECT_SECONDS later, doubling to
        RECONNECT_MAX_SECONDS; the pulls between fail at once."""
        now = time.monotonic()
        lost = self._remotes.get(key)
        if lost is not None:
            self._drop(key)
            self._lost[key] = (lost.reply, now, RECONNECT_SECONDS)
        reply, next_try, wait = self._lost[key]
        if now < next_try:
            raise _pull_error(request_id, peer_name(*key), "unreachable since a READ from it "
                              f"failed; reconnecting in {next_try - now:.1f} s")  # fmt: skip
        self._lost[key] = (reply, now + wait, min(2 * wait, RECONNECT_MAX_SECONDS))
        try:
            self.connect(reply)
        except KVTransferError as exc:
            raise _pull_error(request_id, peer_name(*key), f"reconnecting failed: {exc}") from exc
        log.info("kv_remote_reconnected", peer=peer_name(*key), request_id=request_id)
        return self._remotes[key]

    def _remote_for(self, handle: KVHandle, replica: int, request_id: str) -> Remote:
        if not 0 <= replica < len(handle.replicas):
            raise KVTransferError(
                f"KV pull of request {request_id!r}: replica {replica} out of range, handle of "
                f"engine {handle.engine_id!r} epoch {handle.epoch} has {len(handle.replicas)}"
            )
        agent = handle.replicas[replica].agent_name
        key = (handle.engine_id, handle.epoch, agent)
        remote = self._remotes.get(key)
        if (remote is not None and remote.failed and not remote.num_posted) or key in self._lost:
            remote = self._reconnect(key, request_id)
        if remote is not None:
            return remote
        peer = peer_name(handle.engine_id, handle.epoch, agent)
        epochs = sorted({k[1] for k in self._remotes if k[0] == handle.engine_id})
        why = f"stale epoch (connected: {epochs})" if epochs else "not connected (no handshake)"
        raise _pull_error(request_id, peer, f"refused, {why}")

    # -- pulls ----------------------------------------------------------------------------

    def start_pull(
        self,
        request_id: str,
        handle: KVHandle,
        local_block_ids: list[int],
        replica: int = 0,
        heads: list[tuple[int, int, int]] | None = None,
        from_host: bool = False,
    ) -> Pull:
        """Post a READ of handle.block_ids (on replica ``replica``) into local_block_ids.

        ``heads``: (remote first head, local first head, count) slices of the remote
        rank's KV heads to read (tp.pull_plan); None reads every head into the same one.
        ``from_host``: the ids are slots of the producer's host tier (KVHandle.host_slots),
        read with DRAM descriptors."""
        started = time.perf_counter()
        remote = self._remote_for(handle, replica, request_id)
        peer = peer_name(handle.engine_id, handle.epoch, remote.reply.agent_name)
        rlayout, remote_units, remote_blocks = remote.reply.layout, remote.dlist, remote.blocks
        if from_host:
            if remote.host_layout is None:
                raise _pull_error(request_id, peer, "refused, it serves no host tier")
            rlayout, remote_units, remote_blocks = (
                remote.host_layout,
                remote.host_dlist,
                remote.host_blocks,
            )
        try:
            local_ids = np.array(local_block_ids, dtype=np.int64)
            remote_ids = np.array(handle.block_ids, dtype=np.int64)
        except (OverflowError, ValueError, TypeError) as exc:
            raise _pull_error(
                request_id, peer, f"refused, block ids are not block numbers: {exc}"
            ) from exc
        num_remote = rlayout.num_blocks
        check_ids(self.layout, request_id, peer, handle, remote, local_ids, remote_ids, num_remote)
        local_ids, remote_ids = (
            local_ids.astype(np.int32),
            remote_ids.astype(np.int32),
        )  # in range now
        if heads is None:
            heads = [(0, 0, self.layout.num_kv_heads)]
        check_heads(self.layout, request_id, peer, remote, heads)
        num_heads = sum(n for _, _, n in heads)
        if (
            remote_blocks is not None
            and self._local_blocks is not None
            and heads == [(0, 0, rlayout.num_kv_heads)]
            and rlayout.num_kv_heads == self.layout.num_kv_heads
        ):
            # Every head, both caches block-major: whole blocks, indexed by block id.
            local_list, remote_list, local_idx, remote_idx = (
                self._local_blocks,
                remote_blocks,
                local_ids,
                remote_ids,
            )
        else:
            # (head, block) units; NIXL merges pairs contiguous on both sides into one
            # descriptor: one per head and run of blocks (fewer when runs meet across
            # heads). Enumerated so that units adjacent in memory on both sides are
            # adjacent in the lists: block by block when both are block-major, else
            # head by head.
            by_block = self.layout.order == rlayout.order == "block"
            local_list, remote_list = self._local_dlist, remote_units
            local_idx = np.concatenate(
                [unit_indices(local_ids, self.layout, dst, n, by_block) for _, dst, n in heads]
            )
            remote_idx = np.concatenate(
                [unit_indices(remote_ids, rlayout, src, n, by_block) for src, _, n in heads]
            )
        pull = Pull(
            request_id=request_id,
            peer=peer,
            remote=remote,
            num_descriptors=0,
            num_bytes=len(local_ids) * num_heads * self.layout.head_block_bytes,
            started_at=started,
            from_host=from_host,
        )
        if not len(local_idx):  # NIXL refuses an empty request: done at once
            pull.posted_at = pull.done_at = time.perf_counter()
            return pull
        try:
            pull.xfer = self._agent.make_prepped_xfer(
                "READ",
                local_list,
                local_idx,
                remote_list,
                remote_idx,
            )
            remote.num_posted += 1
            state = self._agent.transfer(pull.xfer)
        except Exception as exc:
            self._finish(pull, f"posting the READ failed: {exc!r}")
            raise _pull_error(request_id, peer, pull.error or "") from exc
        pull.posted_at = time.perf_counter()
        if state == "ERR":
            self._finish(pull, "posting the READ failed: NIXL state ERR")
            raise _pull_error(request_id, peer, pull.error or "")
        pull.num_descriptors = num_runs(remote_idx, local_idx)  # counted while the READ runs
        return pull

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
            if pull.remote is not None:
                pull.remote.num_posted -= 1
            try:
                xfer.release()
            except Exception as exc:  # noqa: BLE001 - NIXL keeps it and retries at agent teardown
                log.warning(
                    "kv_xfer_release_failed",
                    request_id=pull.request_id,
                    peer=pull.peer,
                    error=repr(exc),
                )

    # -- releases -------------------------------------------------------------------------

    def release(self, handle: KVHandle, request_id: str, trace_id: str = "") -> list[int]:
        """Notify EVERY replica (read from or not) that the request's blocks may be freed.
        Returns the replica indices not notified: the caller falls back to the side channel."""
        failed = []
        for index, replica in enumerate(handle.replicas):
            message = encode(release_of(handle, request_id, trace_id, index))
            key = (handle.engine_id, handle.epoch, replica.agent_name)
            try:
                if key not in self._remotes:
                    raise KVTransferError("not connected")
                if self._remotes[key].failed:
                    raise KVTransferError("a READ from it failed")
                self._notifier.send_notif(replica.agent_name, message)
            except Exception as exc:  # noqa: BLE001
                failed.append(index)
                log.warning(
                    "kv_release_notification_failed",
                    request_id=request_id,
                    trace_id=trace_id,
                    peer=peer_name(*key),
                    error=repr(exc),
                )
        return failed

    def progress(self) -> None:
        """Drive UCX. Agents run without a progress thread (it spins: ~25% of a core per
        idle agent on the 2-core CI kind), so the owner's loop calls this every
        iteration, idle or not, for queued release notifications to go out."""
        for agent in (self._agent, self._notifier):
            for sender, messages in agent.get_new_notifs().items():
                log.warning(
                    "kv_unexpected_notification",
                    agent=self.agent_name,
                    sender=sender,
                    count=len(messages),
                )

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
