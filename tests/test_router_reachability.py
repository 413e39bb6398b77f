"""Issue 41: the router's choice of a (prefill, decode) pair while a decode reports a
prefill it cannot pull from (services/router/links.py), without sockets: a prefill some
live decode reaches is chosen, then a decode that reaches it; with none, every instance as
before (the pull fails or is recomputed as kv_load_failure_policy says)."""

from __future__ import annotations

import time

from pdserve.common.transfer.kv_pulls import is_unreachable
from pdserve.services.router.links import Link, decodes_reaching, pick, reachable_prefills

TIMEOUT = 5.0


def link(role: str, index: int, unreachable: tuple[str, ...] = (), alive: bool = True) -> Link:
    return Link(role=role, index=index, address="", sock=None, ready=alive,
                last_pong=time.monotonic(), unreachable=frozenset(unreachable))  # fmt: skip


def names(links: list[Link]) -> list[str]:
    return [x.name for x in links]


def test_every_instance_while_every_decode_reaches_every_prefill() -> None:
    prefills, decodes = [link("prefill", 0), link("prefill", 1)], [link("decode", 0)]
    now = time.monotonic()
    assert names(reachable_prefills(prefills, decodes, now, TIMEOUT)) == names(prefills)
    assert names(decodes_reaching("prefill-0", decodes, now, TIMEOUT)) == ["decode-0"]


def test_a_prefill_cut_from_every_decode_is_passed_over() -> None:
    prefills = [link("prefill", 0), link("prefill", 1)]
    decodes = [link("decode", 0, ("prefill-0",)), link("decode", 1, ("prefill-0",))]
    now = time.monotonic()
    chosen = reachable_prefills(prefills, decodes, now, TIMEOUT)
    assert names(chosen) == ["prefill-1"]
    prefills[1].outstanding_tokens = 10_000  # busier, but the only one reached
    assert pick(chosen, None, TIMEOUT) is prefills[1]


def test_a_prefill_cut_from_one_decode_goes_to_the_other() -> None:
    prefills = [link("prefill", 0), link("prefill", 1)]
    decodes = [link("decode", 0, ("prefill-0",)), link("decode", 1)]
    now = time.monotonic()
    assert names(reachable_prefills(prefills, decodes, now, TIMEOUT)) == names(prefills)
    decodes[1].outstanding_tokens = 10_000  # busier, but the only one reaching prefill-0
    assert names(decodes_reaching("prefill-0", decodes, now, TIMEOUT)) == ["decode-1"]
    assert names(decodes_reaching("prefill-1", decodes, now, TIMEOUT)) == names(decodes)


def test_only_live_instances_count() -> None:
    # prefill-1 is down: prefill-0, though cut from the live decode, is all there is
    prefills = [link("prefill", 0), link("prefill", 1, alive=False)]
    decodes = [link("decode", 0, ("prefill-0",)), link("decode", 1, alive=False)]
    now = time.monotonic()
    assert names(reachable_prefills(prefills, decodes, now, TIMEOUT)) == names(prefills)
    # the one decode reaching prefill-0 is down: every decode, as before
    assert names(decodes_reaching("prefill-0", decodes, now, TIMEOUT)) == names(decodes)
    # a dead decode's report does not make a prefill reachable
    decodes = [link("decode", 0, ("prefill-0",)), link("decode", 1, alive=False)]
    prefills = [link("prefill", 0), link("prefill", 1)]
    assert names(reachable_prefills(prefills, decodes, now, TIMEOUT)) == ["prefill-1"]


def test_with_no_pair_reachable_every_prefill_is_offered() -> None:
    prefills = [link("prefill", 0), link("prefill", 1)]
    decodes = [link("decode", 0, ("prefill-0", "prefill-1"))]
    now = time.monotonic()
    assert names(reachable_prefills(prefills, decodes, now, TIMEOUT)) == names(prefills)
    assert names(decodes_reaching("prefill-1", decodes, now, TIMEOUT)) == ["decode-0"]


def test_which_pull_errors_say_unreachable() -> None:
    head = "KV pull of request 'r' from prefill-0 epoch 3 rank 0: "
    for why in (
        "transfer failed: NIXL state ERR",
        "posting the READ failed: NIXL state ERR",
        "unreachable since a READ from it failed; reconnecting in 1.2 s",
        "reconnecting failed: KV handshake with prefill-0: loading its NIXL metadata failed",
    ):
        assert is_unreachable(head + why), why
    for why in ("refused, stale epoch (connected: [4])", "refused, it serves no host tier"):
        assert not is_unreachable(head + why), why
