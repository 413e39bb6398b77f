"""The two processes of ``pdserve bench transfer``: a producer serving a KV cache with the
real ``KVProducer``, and a consumer pulling from it with the real ``KVConsumer``, which
also measures the two ceilings of each row (one raw NIXL READ of the same bytes as a
single descriptor, and a plain local copy of them).

Only the public API of ``kv_layout`` / ``kv_transfer`` is used: the memory order is free
to change (block-major, head-major for TP), so the content is written and checked through
the logical view (blocks found by the position of ``num_blocks`` in ``KVLayout.shape``),
and the ceilings work on the raw bytes of the cache's storage (cli/bench/transfer_cache.py: the
shapes, the pattern, the raw agent).
"""

from __future__ import annotations

import os
import statistics
import time
import traceback
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

from pdserve.cli.bench.transfer_cache import (
    ENGINE_ID,
    EPOCH,
    RawAgent,
    check,
    compat_of,
    fill,
    fragmented_ids,
    make_layout,
    new_cache,
    num_blocks_for,
    storage_bytes,
    sync_device,
)

if TYPE_CHECKING:
    import torch

    from pdserve.common.engine.kv_layout import KVLayout
    from pdserve.common.runtime.protocol import HandshakeReply, KVHandle
    from pdserve.common.transfer.kv_consumer import KVConsumer
    from pdserve.common.transfer.kv_pull_state import Pull

# -- the producer -------------------------------------------------------------------------


def producer_main(conn: Connection, spec: dict[str, Any]) -> None:
    """Serve the patterned cache; answer ("releases", n) once n releases came, or on time out."""
    from pdserve.common.runtime.protocol import encode
    from pdserve.common.transfer.kv_transfer import KVProducer

    producer = raw = None
    try:
        layout = make_layout(spec["shape"], spec["num_blocks"], spec["order"], spec["dtype"])
        cache = new_cache(layout, spec["device"])
        fill(cache, layout)
        sync_device(spec["device"])  # filled before any reader's copy engine can see it
        producer = KVProducer(
            engine_id=ENGINE_ID, epoch=EPOCH, agent_name=f"bench-producer-{os.getpid()}",
            kv_cache=cache, layout=layout, compat=compat_of(spec["dtype"]), num_threads=spec["num_threads"],
        )  # fmt: skip
        raw = RawAgent(f"bench-producer-raw-{os.getpid()}", cache, spec["num_threads"])
        conn.send(
            ("ready", (encode(producer.handshake_reply), raw.agent.get_agent_metadata(), raw.base))
        )
        releases, want, deadline = 0, None, 0.0
        while True:
            releases += len(producer.poll_releases())
            raw.agent.get_new_notifs()  # drives UCX: the raw reader's wire-up needs our answer
            if want is not None and (releases >= want or time.monotonic() > deadline):
                conn.send(("releases", releases))
                want = None
            if conn.poll(spec["producer_poll_ms"] / 1e3):  # our agents progress between waits
                command, arg = conn.recv()
                if command == "stop":
                    return
                want, deadline = arg, time.monotonic() + 10.0
    except (EOFError, BrokenPipeError):  # the launcher is gone
        pass
    except BaseException:  # noqa: BLE001 - reported to the launcher, which says who failed
        conn.send(("error", traceback.format_exc()))
    finally:
        for agent in (raw, producer):
            if agent is not None:
                agent.close()


# -- the consumer -------------------------------------------------------------------------


def consumer_main(conn: Connection, spec: dict[str, Any]) -> None:
    """Connect to the producer, then measure every (tokens, pattern) row and send it."""
    from pdserve.common.runtime.protocol import Decoder, HandshakeReply
    from pdserve.common.transfer.kv_consumer import KVConsumer

    consumer = checker = raw = None
    try:
        device = spec["device"]
        layout = make_layout(spec["shape"], spec["num_blocks"], spec["order"], spec["dtype"])
        cache = new_cache(layout, device)
        # Timed pulls run as decode runs them (no NIXL telemetry); a second agent with
        # telemetry makes each row's checked first pull, for NIXL's own descriptor count.
        consumer = KVConsumer(
            agent_name=f"bench-consumer-{os.getpid()}", kv_cache=cache, layout=layout,
            compat=compat_of(spec["dtype"]), num_threads=spec["num_threads"],
        )  # fmt: skip
        checker = KVConsumer(
            agent_name=f"bench-checker-{os.getpid()}", kv_cache=cache, layout=layout,
            compat=compat_of(spec["dtype"]), num_threads=spec["num_threads"], capture_telemetry=True,
        )  # fmt: skip
        raw = RawAgent(f"bench-consumer-raw-{os.getpid()}", cache, spec["num_threads"])
        command, (reply_bytes, raw_metadata, raw_base) = conn.recv()
        assert command == "producer", command
        reply: HandshakeReply = Decoder(HandshakeReply).decode(reply_bytes)
        started = time.perf_counter()
        consumer.connect(reply)
        connect_s = time.perf_counter() - started
        checker.connect(reply)
        remote_raw = raw.agent.add_remote_agent(raw_metadata)
        remote_raw = remote_raw.decode() if isinstance(remote_raw, bytes) else remote_raw
        peers = _Peers(consumer, checker, raw, cache, layout, reply, remote_raw, raw_base, device)
        for tokens in spec["tokens"]:
            for run_blocks in [None, *spec["fragment"]]:
                row = peers.measure(tokens, run_blocks, spec["repeats"])
                row["connect_ms"] = connect_s * 1e3
                conn.send(("row", row))
        conn.send(("done", peers.num_pulls))
        conn.recv()  # stay until told: the producer counts our releases first
    except (EOFError, BrokenPipeError):
        pass
    except BaseException:  # noqa: BLE001
        conn.send(("error", traceback.format_exc()))
    finally:
        for agent in (raw, checker, consumer):
            if agent is not None:
                agent.close()


class _Peers:
    """The consumer's side of one shape: our pull, the raw READ and the copy, taking turns."""

    def __init__(
        self, consumer: KVConsumer, checker: KVConsumer, raw: RawAgent, cache: torch.Tensor,
        layout: KVLayout, reply: HandshakeReply, remote_raw: str, remote_base: int, device: str,
    ) -> None:  # fmt: skip
        self.consumer, self.checker, self.raw, self.cache, self.layout = (
            consumer,
            checker,
            raw,
            cache,
            layout,
        )
        self.reply, self.remote_raw, self.remote_base, self.device = (
            reply,
            remote_raw,
            remote_base,
            device,
        )
        self.num_pulls = 0

    def handle(self, tokens: int, remote_ids: list[int]) -> KVHandle:
        from pdserve.common.runtime.protocol import KVHandle, Replica

        r = self.reply
        return KVHandle(
            engine_id=r.engine_id, epoch=r.epoch, layout=r.layout, block_ids=remote_ids,
            num_tokens=tokens, replicas=[Replica(agent_name=r.agent_name, side_channel="")],
            lease_deadline=0.0,
        )  # fmt: skip

    def pull(
        self, handle: KVHandle, local_ids: list[int], consumer: KVConsumer | None = None
    ) -> Pull:
        """handshake done -> start_pull -> poll until done -> release, as decode does."""
        consumer = consumer or self.consumer
        self.num_pulls += 1
        rid = f"bench-{self.num_pulls}"
        pull = consumer.start_pull(rid, handle, local_ids)
        while not consumer.poll(pull):
            pass
        consumer.release(handle, rid)
        for agent in (self.consumer, self.checker):  # (untimed) queued release notifications go out
            agent.progress()
        return pull

    def copy(self, num_bytes: int) -> float:
        flat = storage_bytes(self.cache)
        half = flat.numel() // 2
        src, dst = flat[:num_bytes], flat[half : half + num_bytes]
        sync_device(self.device)
        start = time.perf_counter()
        dst.copy_(src)
        sync_device(self.device)
        return time.perf_counter() - start

    def measure(self, tokens: int, run_blocks: int | None, repeats: int) -> dict[str, Any]:
        num = num_blocks_for(tokens)
        local_ids = list(range(num))
        remote_ids = local_ids if run_blocks is None else fragmented_ids(num, run_blocks)
        handle = self.handle(tokens, remote_ids)
        num_bytes = num * self.layout.block_bytes
        # A pull into a zeroed cache, checked (the checker's: NIXL's count), an untimed
        # warm-up of the timed agent, then every timed repeat takes turns.
        self.cache.zero_()
        sync_device(self.device)
        checked = self.pull(handle, local_ids, self.checker)
        sync_device(self.device)
        check(self.cache, self.layout, local_ids, remote_ids)
        first = self.pull(handle, local_ids)
        lists = self.raw.read(self.remote_raw, self.remote_base, num_bytes)
        self.raw.run(lists)
        self.copy(num_bytes)
        pulls, ceilings, copies = [], [], []
        for i in range(repeats):  # the order alternates: neither side always goes first
            if i % 2:
                pulls.append(self.pull(handle, local_ids))
            ceilings.append(self.raw.run(lists))
            copies.append(self.copy(num_bytes))
            if not i % 2:
                pulls.append(self.pull(handle, local_ids))
        for dlist in lists:
            dlist.release()
        pull_s = statistics.median(p.transfer_seconds or 0.0 for p in pulls)
        ceiling_s, copy_s = statistics.median(ceilings), statistics.median(copies)
        gbps, ceiling_gbps = num_bytes / pull_s / 1e9, num_bytes / ceiling_s / 1e9
        return {
            "pattern": "contiguous" if run_blocks is None else "fragmented",
            "run_blocks": run_blocks if run_blocks is not None else num,
            "tokens": tokens, "blocks": num, "bytes": num_bytes,
            "bytes_pulled": checked.num_bytes, "layout_block_bytes": self.layout.block_bytes,
            "runs": len(_runs(remote_ids)), "descriptors": first.num_descriptors,
            "nixl_descriptors": checked.nixl_descriptors, "repeats": repeats,
            "gbps": gbps, "ceiling_gbps": ceiling_gbps, "copy_gbps": num_bytes / copy_s / 1e9,
            "ratio": gbps / ceiling_gbps,
            # best of the repeats: what a machine shared with other work can still show
            "best_gbps": num_bytes / min(p.transfer_seconds or 0.0 for p in pulls) / 1e9,
            "best_ceiling_gbps": num_bytes / min(ceilings) / 1e9,
            "first_pull_ms": (first.transfer_seconds or 0.0) * 1e3,  # untimed warm-up, after zeroing
            "pull_ms": pull_s * 1e3, "post_ms": statistics.median(p.post_seconds for p in pulls) * 1e3,
            "ceiling_ms": ceiling_s * 1e3, "copy_ms": copy_s * 1e3,
            "pull_ms_all": [(p.transfer_seconds or 0.0) * 1e3 for p in pulls],
            "ceiling_ms_all": [s * 1e3 for s in ceilings], "copy_ms_all": [s * 1e3 for s in copies],
        }  # fmt: skip


def _runs(ids: list[int]) -> list[tuple[int, int]]:
    runs: list[tuple[int, int]] = []
    for b in ids:
        if runs and runs[-1][0] + runs[-1][1] == b:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((b, 1))
    return runs
