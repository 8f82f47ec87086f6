"""Argument types shared by the subcommands (argparse ``type=`` callables)."""

from __future__ import annotations

import argparse


def int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected integers separated by commas: {text!r}"
        ) from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers: {text!r}")
    return values


def ratio_list(text: str) -> list[float]:
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected numbers separated by commas: {text!r}"
        ) from None
    if not values or not all(0 <= v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"hit ratios must lie in [0, 1): {text!r}")
    return values
