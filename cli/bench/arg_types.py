"""argparse types the bench subcommands share: positive integers and lists of them."""

from __future__ import annotations

import argparse


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def gen_len_arg(text: str) -> int:
    value = int(text)
    if value < 2:  # decode is every token after the first; one token has none to time
        raise argparse.ArgumentTypeError(f"must be at least 2, got {value}")
    return value


def positive_ints(text: str) -> list[int]:
    """A comma-separated list of positive integers, e.g. 1,16 (every bench's list flags)."""
    try:
        values = [positive_int(part) for part in text.split(",") if part.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated positive integers, got {text!r}"
        ) from exc
    if not values:
        raise argparse.ArgumentTypeError("no value given")
    return values
