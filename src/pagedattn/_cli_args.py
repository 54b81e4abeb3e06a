"""argparse value types shared by the ``pagedattn`` subcommands."""

from __future__ import annotations

import argparse


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
