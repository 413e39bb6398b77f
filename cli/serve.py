"""``pdserve router|prefill|decode``: run one service (a systemd unit runs one of these)."""

from __future__ import annotations

import argparse
from typing import Any


def add_parsers(sub: Any) -> None:
    for role in ("router", "prefill", "decode"):
        p = sub.add_parser(role, help=f"run the {role} service")
        p.add_argument(
            "--config", default=None, help="TOML file (PDSERVE_* env and flags override)"
        )
        if role != "router":
            p.add_argument("--instance", type=int, default=0, help="which configured instance")
        p.add_argument("--model", default=None)
        p.add_argument("--device", default=None)
        p.add_argument("--http-port", type=int, default=None)
        p.set_defaults(run=run, role=role)


def run(args: argparse.Namespace) -> int:
    import uvloop

    from pdserve.common.runtime.log import configure_logging
    from pdserve.common.runtime.service_config import load_config, torch_threads_for

    cfg = load_config(args.config, model=args.model, device=args.device, http_port=args.http_port)
    configure_logging(cfg.log_level)
    if args.role == "router":
        from pdserve.services.router.main import serve

        uvloop.run(serve(cfg))
        return 0
    threads = torch_threads_for(cfg, args.role)
    from pdserve.common.runtime.net_scope import check_bindable, confine_to, set_ucx

    addresses = cfg.addresses_of(args.role)
    if 0 <= args.instance < len(addresses):  # else the service names the bad instance
        check_bindable(f"{args.role} {args.instance}", addresses[args.instance])
        # before any NIXL agent or rank starts
        confine_to(addresses[args.instance].address)
        set_ucx(cfg.ucx, cfg.lease_seconds, cfg.heartbeat_seconds)
    if args.role == "prefill":
        from pdserve.services.prefill.service import PrefillService

        uvloop.run(PrefillService(cfg, args.instance, threads).run())
    else:
        from pdserve.services.decode.service import DecodeService

        uvloop.run(DecodeService(cfg, args.instance, threads).run())
    return 0
