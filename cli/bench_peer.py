"""``pdserve bench serve --peer-url``: the same loads against another OpenAI server.

The peer (vLLM, SGLang, another pdserve) gets, load for load, the requests pdserve got:
the same prompts (the seed of each load and the token-id range pdserve's own server gave),
the same concurrency, output length and arrivals. Its runs join the table, the JSON and
the plot (benchmarks/plot_serve.py) as one more mode, named by --peer-label. Requests to
the peer name its model (its /v1/models), as servers other than pdserve may require.
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Callable
from typing import Any

MODES = ("disaggregated", "colocated")


def add_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--peer-url",
        default=None,
        metavar="URL",
        help="also run every load against this OpenAI-compatible server (e.g. vLLM at "
        "http://127.0.0.1:8011), same prompts and concurrency, after pdserve's",
    )
    p.add_argument("--peer-label", default="peer", help="the peer's name in the table and plot")
    p.add_argument(
        "--modes",
        type=_modes,
        default=list(MODES),
        help="--compare: the deployments to start, in order (default: disaggregated,colocated)",
    )


def _modes(text: str) -> list[str]:
    modes = [m.strip() for m in text.split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        raise argparse.ArgumentTypeError(
            f"unknown mode(s) {', '.join(bad) or '(none)'}; choose from {', '.join(MODES)}"
        )
    return modes


def peer_runs(
    args: argparse.Namespace,
    loads: list[int | None],
    token_id_range: tuple[int, int],
    run_load: Callable[..., Any],
    for_load: Callable[[argparse.Namespace, int, int | None], argparse.Namespace],
) -> list[dict[str, Any]]:
    """One run per load against ``args.peer_url``, each with the prompts pdserve's run of
    that load had (``for_load`` gives the seed, ``token_id_range`` the ids)."""
    label = args.peer_label
    runs = []
    for index, load in enumerate(loads):
        load_args = for_load(args, index, load)
        load_args.token_id_range = token_id_range
        load_args.name_model = True
        name = label if len(loads) == 1 else f"{label} c={load or 'inf'}"
        result = asyncio.run(run_load(args.peer_url, load_args, name))
        result.update(load=load, mode=label, peer=True)
        runs.append(result)
    return runs
