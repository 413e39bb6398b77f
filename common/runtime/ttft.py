"""Time to first token, split into its parts along a disaggregated request's path (pure).

Each service stamps the moments it sees (wall clock, ``time.time()``) into a ``timings``
dict that travels with the request: prefill in ``PrefillDone.timings``, decode in the
first ``TokenChunk.timings``. The router adds its own two (arrival and the first chunk's
receipt) and turns consecutive marks into parts, which therefore add up to the router's
TTFT exactly. Marks from different hosts are as good as their clocks' agreement (NTP:
well under a millisecond on a LAN); on one host they share one clock.

    arrived --queue--> prefill_scheduled --prefill--> prefill_done --handoff-->
    decode_received --handshake--> handshake_done --blocks--> pull_started --pull-->
    pull_done --first_chunk--> first_chunk --return--> (router receives it)

queue: router dispatch, transit, waiting in prefill's queue until a step first computes
the prompt. prefill: the prompt's steps (chunked prefill: all of them) and the first token.
handoff: PrefillDone to the router and DecodeRequest to decode. handshake: waiting for the
producer's KV handshake (0 when connected ahead). blocks: waiting for free decode blocks.
pull: the NIXL READs. first_chunk: admitting the pulled request and sending the first
token, which prefill sampled (no decode step is part of TTFT). return: the chunk's trip to
the router.
"""

from __future__ import annotations

MARKS = (
    "arrived", "prefill_scheduled", "prefill_done", "decode_received", "handshake_done",
    "pull_started", "pull_done", "first_chunk", "router_first_chunk",
)  # fmt: skip
PARTS = ("queue", "prefill", "handoff", "handshake", "blocks", "pull", "first_chunk", "return")


def ttft_parts(marks: dict[str, float]) -> dict[str, float]:
    """Seconds of each part whose two bounding marks are both known; a negative span (clocks
    of two hosts disagreeing) counts as 0."""
    parts = {}
    for part, start, end in zip(PARTS, MARKS[:-1], MARKS[1:], strict=True):
        if start in marks and end in marks:
            parts[part] = max(0.0, marks[end] - marks[start])
    return parts
