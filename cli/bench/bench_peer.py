"""``pdserve bench serve --peer-url``: the same loads against another OpenAI server.

The peer (vLLM, SGLang, another pdserve) gets, load for load, the requests pdserve got:
the same prompts (the seed of each load and the token-id range pdserve's own server gave),
the same concurrency, rates, lengths and arrivals. Its runs join the table, the JSON and
the plot (benchmarks/plot_serve.py) as one more mode, named by --peer-label. Requests to
the peer name its model (its /v1/models), as servers other than pdserve may require.
"""

from __future__ import annotations

import argparse
from typing import Any

from pdserve.cli.bench.serve_http import run_loads
from pdserve.cli.bench.serve_load import Load

MODES = ("disaggregated", "colocated", "conditional")


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
        help="--compare: the deployments to start, in order (default: disaggregated,"
        "colocated,conditional; conditional: short prompts prefilled on decode, "
        "local_prefill_threshold)",
    )


def _modes(text: str) -> list[str]:
    modes = [m.strip() for m in text.split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        raise argparse.ArgumentTypeError(
            f"unknown mode(s) {', '.join(bad) or '(none)'}; choose from {', '.join(MODES)}"
        )
    return modes


def peer_runs(args: argparse.Namespace, loads: list[Load],
              token_id_range: tuple[int, int]) -> list[dict[str, Any]]:  # fmt: skip
    """One run per load against ``args.peer_url``, each with the prompts, lengths and
    arrivals pdserve's run of that load had (the same seeds; ``token_id_range`` the ids)."""
    runs = run_loads(args.peer_url, args, loads, args.peer_label,
                     token_id_range=token_id_range, name_model=True)  # fmt: skip
    for run in runs:
        run["peer"] = True
    return runs
