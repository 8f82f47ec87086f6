"""Errors and TOML tables: what every configuration module shares."""

from __future__ import annotations

import dataclasses
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any


class ConfigError(ValueError):
    """A configuration value or file that Vertumnus cannot use."""


def read_toml(path: Path) -> dict[str, Any]:
    """A TOML file as a dict; ConfigError naming the file if it cannot be read."""
    try:
        return tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"{path}: {exc}") from exc


def build_table(cls: type[Any], values: Mapping[str, Any], where: str, base: Any = None) -> Any:
    """``cls(**values)`` for a TOML table ``[where]``, the fields not given taken from
    ``base`` (an instance of ``cls``; None: the class defaults). Unknown keys and bad
    values raise ConfigError naming the table."""
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - names)
    if unknown:
        raise ConfigError(f"[{where}] unknown keys {unknown}; known: {sorted(names)}")
    try:
        if base is not None:
            return dataclasses.replace(base, **values)
        return cls(**values)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"[{where}] {exc}") from exc
