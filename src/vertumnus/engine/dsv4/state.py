"""What DeepSeek-V4 keeps of a prompt so that a later prefill (a cached prefix, the
next decode step) resumes it exactly: per layer, the window's last raw rows, every
compressed entry and indexer key so far, and each compressor's unfinished business.

Model (``compress.py``): entry ``w`` pools window ``[w r, (w + 1) r)``, and a CSA
entry also the first half of the channels of window ``w - 1`` (``Ca``). So a prompt of
``length`` tokens leaves, per compressed layer:

- the ``length // r`` entries (and indexer keys) of its whole windows;
- its *open* window: the projection rows of ``[length // r * r, length)``, fewer than
  ``r``, not pooled yet (none when ``length`` is a multiple of ``r``);
- for CSA, the ``Ca`` halves of its last whole window, which the next entry pools.

Every layer keeps the last ``window - 1`` raw (shared K = V) rows, the keys a query
after ``length`` still sees. Projection rows are kept as computed (the gate without
its position bias: the bias belongs to the slot, added where a window is pooled).

A ``Head`` is the same facts about what precedes one segment of a prefill, whether a
state gives them or the rank that computed the chunk before sends them (``zigzag.py``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import torch
from safetensors.torch import load, save
from torch import Tensor


@dataclass
class Head:
    """What one segment's queries and windows need of the tokens before it."""

    raw: Tensor  # [n <= window - 1, D] the raw rows just before it
    prior: list[Tensor] = field(default_factory=list)  # CSA: Ca halves [r, half] x 4
    open: list[Tensor] = field(default_factory=list)  # open-window rows [m < r, W] x 2 or 4


@dataclass
class LayerState:
    raw: Tensor  # [n <= window - 1, D]
    entries: Tensor | None = None  # [length // r, D] (compressed layers)
    index_keys: Tensor | None = None  # [length // r, Di] (CSA)
    open: list[Tensor] = field(default_factory=list)  # comp kv, gate (, index kv, gate)
    prior: list[Tensor] = field(default_factory=list)  # CSA: Ca halves, same order

    def head(self) -> Head:
        return Head(self.raw, self.prior, self.open)


@dataclass
class DsV4State:
    """A prompt's resumable state: ``length`` tokens, one ``LayerState`` per layer."""

    length: int
    layers: list[LayerState]


def assemble(
    head: Head,
    span: Tensor,
    widths: list[int],
    ratio: int,
    window: int,
    entries: tuple[Tensor | None, Tensor | None],
) -> LayerState:
    """A layer's state from the rows of its span (``span`` [n, D + W]: raw, then the
    projections of ``widths``), starting on a window boundary after ``head``, and every
    entry (and indexer key) of the prompt."""
    d = span.shape[1] - sum(widths)
    raw, at, rows = span[:, :d], d, []
    for w in widths:
        rows.append(span[:, at : at + w])
        at += w
    return advance(head, rows, raw, ratio, window, entries)


def advance(
    head: Head,
    rows: list[Tensor],
    raw: Tensor,
    ratio: int,
    window: int,
    entries: tuple[Tensor | None, Tensor | None],
) -> LayerState:
    """A layer's state after ``raw`` [R, D] more tokens whose projection rows are
    ``rows`` ([R, W] each: comp kv, gate, and for CSA index kv, gate), following
    ``head``, with every entry (and indexer key) of the prompt so far: the raw rows,
    open rows and CSA prior a later prefill resumes from, copied out."""
    kept = torch.cat((head.raw, raw))[-(window - 1) :] if window > 1 else raw[:0]
    open_rows: list[Tensor] = []
    prior: list[Tensor] = []
    if ratio:
        joined = (
            [torch.cat(pair) for pair in zip(head.open, rows, strict=True)] if head.open else rows
        )
        whole = joined[0].shape[0] // ratio * ratio
        open_rows = [t[whole:] for t in joined]
        prior = head.prior
        if len(rows) == 4 and whole:  # CSA: the last whole window's Ca halves
            last = slice(whole - ratio, whole)
            prior = [t[last, : t.shape[-1] // 2] for t in joined]
    return LayerState(
        raw=kept.clone(),
        entries=None if entries[0] is None else entries[0].clone(),
        index_keys=None if entries[1] is None else entries[1].clone(),
        open=[t.clone() for t in open_rows],
        prior=[t.clone() for t in prior],
    )


def to_bytes(state: DsV4State) -> bytes:
    """The state as one safetensors blob (what a hand-off carries): tensors named
    ``L.raw``, ``L.entries``, ``L.index_keys``, ``L.open.i``, ``L.prior.i``."""
    tensors: dict[str, Tensor] = {}
    for i, layer in enumerate(state.layers):
        tensors[f"{i}.raw"] = layer.raw
        if layer.entries is not None:
            tensors[f"{i}.entries"] = layer.entries
        if layer.index_keys is not None:
            tensors[f"{i}.index_keys"] = layer.index_keys
        for kind in ("open", "prior"):
            for j, t in enumerate(getattr(layer, kind)):
                tensors[f"{i}.{kind}.{j}"] = t
    meta = {"length": str(state.length), "layers": str(len(state.layers))}
    contiguous = {k: v.detach().contiguous().cpu() for k, v in tensors.items()}
    return save(contiguous, metadata=meta)


def from_bytes(blob: bytes) -> DsV4State:
    """``to_bytes``'s inverse (ValueError for a blob that is not one)."""
    try:
        meta = _metadata(blob)
        tensors = load(blob)
        length, count = int(meta["length"]), int(meta["layers"])
    except Exception as exc:
        raise ValueError(f"not a DeepSeek-V4 state: {exc}") from None
    layers = []
    for i in range(count):

        def listed(kind: str, i: int = i) -> list[Tensor]:
            out, j = [], 0
            while f"{i}.{kind}.{j}" in tensors:
                out.append(tensors[f"{i}.{kind}.{j}"])
                j += 1
            return out

        layers.append(
            LayerState(
                raw=tensors[f"{i}.raw"],
                entries=tensors.get(f"{i}.entries"),
                index_keys=tensors.get(f"{i}.index_keys"),
                open=listed("open"),
                prior=listed("prior"),
            )
        )
    return DsV4State(length, layers)


def _metadata(blob: bytes) -> dict[str, str]:
    """A safetensors blob's metadata (its JSON header's ``__metadata__``)."""
    n = int.from_bytes(blob[:8], "little")
    header = json.loads(blob[8 : 8 + n])
    meta: dict[str, str] = header.get("__metadata__", {})
    return meta
