"""The request storm of the fault suite: many small requests, many cut short by their
client in every way a client can (a protocol-level Abort, the SDK's abort, an SDK stream
left early, an HTTP connection closed mid-stream), so the suite can check that every
accepted request got exactly one terminal reply and that nothing stays allocated.

Raw protocol clients see every frame the router sends, so for them "exactly one terminal
reply, nothing after it" is checked frame by frame; SDK and HTTP clients are checked by
what they return, and all of them by the router's ``pdserve:requests`` count.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
import urllib.parse
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import zmq
import zmq.asyncio

from pdserve.common.engine.sampling_params import SamplingParams
from pdserve.common.runtime import protocol as p
from pdserve.common.runtime.sockets import make_socket

# kind -> share of the storm
KINDS = {
    "raw": 3,
    "raw_abort": 1,
    "raw_abort_at_once": 1,
    "sdk": 1,
    "sdk_abort": 1,
    "sdk_stream_left": 1,
    "http_gone": 1,
    "http": 1,
}
REQUEST_TIMEOUT = 120.0


@dataclass
class StormResult:
    sent: Counter[str] = field(default_factory=Counter)  # kind -> requests
    outcomes: Counter[str] = field(default_factory=Counter)  # "kind:reason" -> requests
    violations: list[str] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def num_requests(self) -> int:
        return sum(self.sent.values())


class RawClient:
    """The client protocol by hand: one DEALER, every frame recorded by request id."""

    def __init__(self, address: str) -> None:
        self.ctx = zmq.asyncio.Context()
        self.sock = make_socket(self.ctx, zmq.DEALER, connect=address, hwm=100_000)
        self.decoder: p.Decoder[Any] = p.Decoder(p.RouterToClient)
        self.frames: dict[str, list[Any]] = {}
        self.ended: dict[str, asyncio.Event] = {}
        self.task = asyncio.create_task(self._receive())

    async def _receive(self) -> None:
        while True:
            msg = self.decoder.decode(await self.sock.recv())
            self.frames.setdefault(msg.request_id, []).append(msg)
            if isinstance(msg, p.Finished | p.Failed) and msg.request_id in self.ended:
                self.ended[msg.request_id].set()

    async def run(
        self, rid: str, ids: list[int], max_tokens: int, abort_after: float | None
    ) -> str:
        self.ended[rid] = asyncio.Event()
        await self.sock.send(
            p.encode(
                p.Generate(
                    request_id=rid,
                    prompt_token_ids=ids,
                    sampling=SamplingParams(max_tokens=max_tokens),
                )
            )
        )
        if abort_after is not None:
            await asyncio.sleep(abort_after)
            await self.sock.send(p.encode(p.Abort(request_id=rid)))
        await asyncio.wait_for(self.ended[rid].wait(), REQUEST_TIMEOUT)
        last = self.frames[rid][-1]
        return last.finish_reason if isinstance(last, p.Finished) else f"failed:{last.reason}"

    def violations(self) -> list[str]:
        bad = []
        for rid in self.ended:
            frames = self.frames.get(rid, [])
            ends = [i for i, f in enumerate(frames) if isinstance(f, p.Finished | p.Failed)]
            if len(ends) != 1 or ends[0] != len(frames) - 1:
                bad.append(
                    f"{rid}: {len(ends)} terminal replies in {[type(f).__name__ for f in frames]}"
                )
        return bad

    async def close(self) -> None:
        self.task.cancel()
        self.sock.close()
        self.ctx.term()


async def _http(url: str, ids: list[int], max_tokens: int, leave_early: bool) -> str:
    """A streaming completion over a raw connection: read to ``[DONE]``, or close the
    connection at the first event (the client is gone)."""
    u = urllib.parse.urlsplit(url)
    reader, writer = await asyncio.open_connection(u.hostname, u.port)
    body = json.dumps(
        {"prompt": ids, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    ).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {u.netloc}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    )
    try:
        writer.write(head.encode() + body)
        await writer.drain()
        status = (await reader.readline()).split()
        if len(status) < 2 or status[1] != b"200":
            return f"http:{status[1:2]}"
        while line := await reader.readline():
            if line.startswith(b"data:"):
                if leave_early:
                    return "gone"
                if line.strip() == b"data: [DONE]":
                    return "done"
        return "eof before [DONE]"
    finally:
        writer.close()


async def storm(front: str, url: str, num: int, concurrency: int, seed: int) -> StormResult:
    from pdserve.services.router.client import AsyncClient, GenerationFailed

    rng = random.Random(seed)
    kinds = [k for k, n in KINDS.items() for _ in range(n)]
    result = StormResult()
    raw = RawClient(front)
    gate = asyncio.Semaphore(concurrency)

    async def one(i: int, sdk: AsyncClient) -> None:
        kind = kinds[i % len(kinds)]
        ids = [rng.randrange(100, 20_000) for _ in range(rng.randrange(4, 24))]
        max_tokens = rng.randrange(1, 5)
        delay = rng.uniform(0.0, 0.3)
        rid = f"storm-{i}"
        async with gate:
            result.sent[kind] += 1
            try:
                if kind.startswith("raw"):
                    after = (
                        None if kind == "raw" else (0.0 if kind == "raw_abort_at_once" else delay)
                    )
                    outcome = await raw.run(rid, ids, max_tokens, after)
                elif kind == "sdk":
                    outcome = (
                        await sdk.generate(
                            prompt_token_ids=ids, max_tokens=max_tokens, request_id=rid
                        )
                    ).finish_reason
                elif kind == "sdk_abort":
                    task = asyncio.create_task(
                        sdk.generate(prompt_token_ids=ids, max_tokens=max_tokens, request_id=rid)
                    )
                    await asyncio.sleep(delay)
                    await sdk.abort(rid)
                    outcome = (await asyncio.wait_for(task, REQUEST_TIMEOUT)).finish_reason
                elif kind == "sdk_stream_left":
                    chunks = sdk.stream(
                        prompt_token_ids=ids, max_tokens=max_tokens + 4, request_id=rid
                    )
                    async for _ in chunks:
                        break
                    await chunks.aclose()  # the SDK sends the Abort
                    outcome = "left"
                else:
                    outcome = await asyncio.wait_for(
                        _http(url, ids, max_tokens, kind == "http_gone"), REQUEST_TIMEOUT
                    )
            except GenerationFailed as exc:
                outcome = f"failed:{exc.reason}"
            except Exception as exc:  # noqa: BLE001 - recorded, the suite fails on it
                outcome = f"error:{type(exc).__name__}"
                result.violations.append(f"{rid} ({kind}): {exc!r}")
            result.outcomes[f"{kind}:{outcome}"] += 1

    started = time.monotonic()
    try:
        async with AsyncClient(front, timeout=REQUEST_TIMEOUT) as sdk:
            await asyncio.gather(*(one(i, sdk) for i in range(num)))
        await asyncio.sleep(1.0)  # frames that would break "nothing after the terminal reply"
        result.violations += raw.violations()
    finally:
        await raw.close()
    result.seconds = time.monotonic() - started
    return result
