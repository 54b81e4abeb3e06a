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
