"""argparse value types shared by the ``pagedattn`` subcommands and the micro-sweeps."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any


def int_list(text: str) -> list[int]:
    """``"1,16,64"`` -> ``[1, 16, 64]``; every value >= 1."""
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}"
        ) from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected comma-separated integers >= 1, got {text!r}")
    return values


def heads_list(text: str) -> list[tuple[int, int]]:
    """``"16/1,32/8"`` -> ``[(16, 1), (32, 8)]``: (query heads, kv heads) pairs, each >= 1."""
    pairs = []
    for item in (v.strip() for v in text.split(",") if v.strip()):
        q, _, kv = item.partition("/")
        try:
            pair = (int(q), int(kv))
        except ValueError:
            pair = None
        if pair is None or min(pair) < 1:
            raise argparse.ArgumentTypeError(
                f"expected comma-separated query/kv head pairs such as 16/1,32/8, got {text!r}"
            )
        pairs.append(pair)
    if not pairs:
        raise argparse.ArgumentTypeError(f"expected query/kv head pairs such as 16/1, got {text!r}")
    return pairs


def choice_list(*choices: str) -> Callable[[str], list[str]]:
    """A type for comma-separated values, each one of ``choices``."""
    expected = f"{', '.join(choices[:-1])} or {choices[-1]}" if len(choices) > 1 else choices[0]

    def parse(text: str) -> list[str]:
        names = [v.strip() for v in text.split(",") if v.strip()]
        if not names or any(n not in choices for n in names):
            raise argparse.ArgumentTypeError(
                f"expected comma-separated values from {expected}, got {text!r}"
            )
        return names

    return parse


def positive(kind: type) -> Callable[[str], Any]:
    """A type for one number of ``kind`` (int or float) > 0."""

    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            value = None
        if value is None or not value > 0:
            raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}")
        return value

    return parse
