"""One request as the router holds it while it runs (`RequestState`), and the phases
whose deadline can fail it."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

from pdserve.common.runtime import protocol as p
from pdserve.services.router.links import Link

MAX_LABEL_CHARS = 128  # a client's own request id, kept as the label its replies carry

Event = p.TokenChunk | p.Finished | p.Failed
PHASES = {  # a request's phases with a deadline: what did not come
    "queue": "no dispatch slot (other requests of this client held its share)",
    "prefill": "no prefill answer",
    "first_token": "no first token",
    "token_gap": "no next token",
}
PHASE_KEYS = {"queue": "first_token_timeout_seconds"}  # else f"{phase}_timeout_seconds"


class SlotGiven:
    """Put in a waiting request's queue when the fair queue gives it a dispatch slot."""


SLOT_GIVEN = SlotGiven()


@dataclass
class RequestState:
    request_id: str  # the router's own, unique; what the services see
    trace_id: str
    num_prompt_tokens: int
    label: str = ""  # the client's id for it: what its replies carry
    owner: str = ""  # the connection that submitted it: only it may abort it
    arrived: float = field(default_factory=time.monotonic)
    marks: dict[str, float] = field(
        default_factory=lambda: {"arrived": time.time()}
    )  # common/runtime/ttft.py
    queue: asyncio.Queue[Any] = field(default_factory=asyncio.Queue)
    link: Link | None = None  # the instance holding the request now
    finished: bool = False
    # prefilled by its decode instance: that link and the tokens in its local backlog
    local_prefill: tuple[Link, int] | None = None
    priority: int = 0  # vLLM's: lower is served first (fair_queue.py, the engines' lines)
    client_class: str = "other"  # its client's label on the per-client metrics
