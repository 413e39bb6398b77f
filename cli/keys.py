"""``pdserve keys --dir DIR [--client NAME ...]``: create the CURVE keys of a deployment."""

from __future__ import annotations

import argparse
import sys
from typing import Any


def add_parser(sub: Any) -> None:
    p = sub.add_parser("keys", help="create CURVE key pairs for [security] curve_keys_dir")
    p.add_argument(
        "--dir", required=True, help="the key directory (created; existing keys are kept)"
    )
    p.add_argument("--client", action="append", default=[], metavar="NAME",
                   help="also create and authorize an SDK client pair NAME (repeatable)")  # fmt: skip
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from pdserve.common.runtime.curve import create_keys

    written = create_keys(args.dir, tuple(args.client))
    for path in written:
        print(path)
    if not written:
        print(f"{args.dir}: every key already exists; nothing written", file=sys.stderr)
    print(f"set [security] curve_keys_dir = {args.dir!r} (or PDSERVE_SECURITY__CURVE_KEYS_DIR); "
          "SDK clients: Client(address, curve=CurveKeys.client(dir, name))", file=sys.stderr)  # fmt: skip
    return 0
