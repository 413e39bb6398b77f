"""The one command-line entry point: ``pdserve <subcommand>``."""

from __future__ import annotations

import argparse
import sys

from pdserve.cli import bench, generate, keys, provenance, serve, up


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    generate.add_parser(sub)
    bench.add_parser(sub)
    serve.add_parsers(sub)
    up.add_parsers(sub)
    keys.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if argv is not None:  # called from Python: sys.argv is the caller's
        provenance.record_command(["pdserve", *argv])
    from pdserve.common.errors import PdserveError

    try:
        return int(args.run(args) or 0)
    except PdserveError as exc:
        print(f"pdserve: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
