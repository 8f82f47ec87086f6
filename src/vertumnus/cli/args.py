"""Argument types and actions shared by the subcommands (argparse ``type=`` callables,
the action that refuses a renamed flag)."""

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


class Renamed(argparse.Action):
    """A flag of an earlier version: refused, naming the flag to write instead."""

    def __init__(self, option_strings: list[str], dest: str, new: str, **kwargs: object) -> None:
        super().__init__(option_strings, dest, **kwargs)  # type: ignore[arg-type]
        self.new = new

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: object,
        option_string: str | None = None,
    ) -> None:
        parser.error(f"{option_string} was renamed: write {self.new} {values}")
