"""Readers of one request field each: the type and range checked, ``BadRequest``
naming the field (``param``) otherwise, the default where the field is absent or
null. Booleans are never numbers here (JSON ``true`` is not 1)."""

from __future__ import annotations

import math
from typing import Any

from vertumnus.protocol.errors import BadRequest

Body = dict[str, Any]


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def integer(
    body: Body, name: str, default: int | None, lo: int | None = None, hi: int | None = None
) -> int | None:
    value = body.get(name)
    if value is None:
        return default
    if not _is_int(value):
        raise BadRequest(f"'{name}' must be an integer", name)
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        span = f"[{lo if lo is not None else '-inf'}, {hi if hi is not None else 'inf'}]"
        raise BadRequest(f"'{name}' must be in {span}, got {value}", name)
    return int(value)


def number(
    body: Body, name: str, default: float, lo: float | None = None, hi: float | None = None
) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise BadRequest(f"'{name}' must be a number", name)
    if math.isnan(value) or (lo is not None and value < lo) or (hi is not None and value > hi):
        span = f"[{lo if lo is not None else '-inf'}, {hi if hi is not None else 'inf'}]"
        raise BadRequest(f"'{name}' must be in {span}, got {value}", name)
    return float(value)


def flag(body: Body, name: str, default: bool = False) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise BadRequest(f"'{name}' must be true or false", name)
    return value


def text(body: Body, name: str) -> str | None:
    value = body.get(name)
    if value is not None and not isinstance(value, str):
        raise BadRequest(f"'{name}' must be a string", name)
    return value


def texts(body: Body, name: str) -> tuple[str, ...]:
    """A string or a list of non-empty strings (``stop``)."""
    value = body.get(name)
    if value is None:
        return ()
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not all(isinstance(s, str) and s for s in items):
        raise BadRequest(f"'{name}' must be a non-empty string or a list of them", name)
    return tuple(items)


def token_ids(body: Body, name: str, vocab_size: int) -> tuple[int, ...]:
    value = body.get(name)
    if value is None:
        return ()
    if not isinstance(value, list) or not all(_is_int(t) for t in value):
        raise BadRequest(f"'{name}' must be a list of token ids", name)
    check_vocab(value, vocab_size, name)
    return tuple(value)


def check_vocab(ids: list[int], vocab_size: int, name: str) -> None:
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise BadRequest(
            f"'{name}': token ids outside the vocabulary [0, {vocab_size}): {bad[:5]}", name
        )


def is_id_list(value: Any) -> bool:
    return isinstance(value, list) and all(_is_int(t) for t in value)


def logit_bias(body: Body, vocab_size: int) -> tuple[tuple[int, float], ...]:
    """``{"token id": bias}``, each bias in [-100, 100] (OpenAI's range)."""
    value = body.get("logit_bias")
    if value is None:
        return ()
    if not isinstance(value, dict):
        raise BadRequest("'logit_bias' must map token ids to numbers", "logit_bias")
    out = []
    for key, bias in value.items():
        try:
            token = int(key)
        except ValueError:
            raise BadRequest(f"'logit_bias': {key!r} is not a token id", "logit_bias") from None
        if not 0 <= token < vocab_size:
            raise BadRequest(
                f"'logit_bias': token id {token} outside the vocabulary [0, {vocab_size})",
                "logit_bias",
            )
        if isinstance(bias, bool) or not isinstance(bias, int | float) or not -100 <= bias <= 100:
            raise BadRequest(
                f"'logit_bias': the bias of {key} must be in [-100, 100]", "logit_bias"
            )
        out.append((token, float(bias)))
    return tuple(sorted(out))


def refuse_unknown(body: Body, known: frozenset[str], off: dict[str, tuple[Any, ...]]) -> None:
    """Every field is known; a field this server does not implement may only be
    absent or take a value that means "off"."""
    unknown = sorted(set(body) - known - set(off))
    if unknown:
        raise BadRequest(f"unknown or unsupported fields {unknown}", unknown[0])
    for name, values in off.items():
        if name in body and body[name] not in values:
            raise BadRequest(f"'{name}' = {body[name]!r} is not supported by this server", name)
