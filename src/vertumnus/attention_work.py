"""Attention work W(R, P): what the execution-time model's ``alpha`` multiplies.

W counts, over the R uncached queries at positions P..P+R-1, the key (or compressed
entry) reads each query makes, in units of one query-key pair of full attention. Each
kind of layer has a prefix function F(n), the work of the queries at positions 0..n-1,
and its work is W(R, P) = F(P + R) - F(P): O(1) to evaluate, and the benefit of
reusing a prefix does not depend on the input length (``policy.costs.ReuseCurve``).

- **Full causal** (kind ``None``): query t reads t + 1 keys; F(n) = n(n+1)/2, so
  W = R*P + R(R+1)/2.
- **Sliding window** of w tokens (kind ``w``, an int; query t reads keys t - w < j <= t):
  min(t + 1, w) keys; F(n) = m(m+1)/2 + (n - m)*w with m = min(n, w).
- **Sliding window plus compressed entries** (kind ``Compressed``: DeepSeek-V4's CSA and
  HCA). Every ``ratio`` tokens are compressed into one entry; query t sees
  e(t) = floor((t+1) / ratio) of them. On top of its window it reads min(topk, e(t))
  entries (all e(t) without a top-k). A top-k needs an indexer, which scores every
  visible entry: e(t) scores per query, each costing ``index_weight`` of a pair
  (DeepSeek-V4: 64 index heads x 128 dims against 64 heads x 512 dims of attention,
  0.25). With S(n) = sum over u = 1..n of floor(u / ratio) = ratio*q(q-1)/2 + q(r+1)
  (q, r = divmod(n, ratio)) and the knee n_k = ratio*topk past which every query reads
  topk entries:

      F(n) = F_window(n) + S(min(n, n_k)) + topk * max(0, n - n_k) + index_weight * S(n)

A model's ``AttentionMix`` (the share of its layers of each kind) makes W the layers'
average, sum over groups of share * W_kind. The mix rides on every degree's
coefficients and is stored once in a profile's JSON (``perfmodel``). Pure Python: the
scheduler and the simulator call ``work`` per request.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any


class ProfileError(ValueError):
    """A sample file or profile that cannot be used (here: its attention mix or a
    layer kind); the message says where and why. ``perfmodel`` raises it too."""


def attention_work(uncached_tokens: int, cached_tokens: int) -> float:
    """W(R, P) = R*P + R*(R+1)/2: query-key pairs left to compute."""
    r, p = uncached_tokens, cached_tokens
    return r * p + r * (r + 1) / 2


def window_work(uncached_tokens: int, cached_tokens: int, window: int | None) -> float:
    """W_w(R, P): one layer's pairs with a sliding window of ``window`` tokens (None:
    full causal attention)."""
    r, p = uncached_tokens, cached_tokens
    if window is None:
        return attention_work(r, p)
    m = min(max(window - p, 0), r)  # the queries that still see their whole prefix
    return m * p + m * (m + 1) / 2 + (r - m) * window


@dataclass(frozen=True)
class Compressed:
    """A layer of sliding-window attention plus compressed entries: one entry per
    ``ratio`` tokens, of which each query reads its ``topk`` best (an indexer scores
    every visible entry, each score ``index_weight`` of a pair) or, with ``topk``
    None, all. DeepSeek-V4's CSA is ``Compressed()``, its HCA ``HCA``."""

    window: int = 128
    ratio: int = 4
    topk: int | None = 512
    index_weight: float = 0.25

    def __post_init__(self) -> None:
        ints = (self.window, self.ratio, 1 if self.topk is None else self.topk)
        if not all(type(v) is int and v >= 1 for v in ints):
            raise ProfileError(f"{self}: window, ratio and topk must be integers >= 1")
        weight = self.index_weight
        if not (isinstance(weight, int | float) and math.isfinite(weight) and weight >= 0):
            raise ProfileError(f"{self}: index_weight must be finite and >= 0")
        if self.topk is None and weight > 0:
            raise ProfileError(f"{self}: an indexer (index_weight > 0) needs a topk")
        object.__setattr__(self, "index_weight", float(weight))

    def prefix_work(self, tokens: int) -> float:
        """F(n): the work of the queries at positions 0..n-1 (module docstring)."""
        n, w, ratio = tokens, self.window, self.ratio
        m = n if n < w else w
        work = m * (m + 1) / 2 + (n - m) * w  # the window's keys
        q, r = divmod(n, ratio)
        seen = ratio * q * (q - 1) // 2 + q * (r + 1)  # S(n)
        if self.topk is None:
            return work + seen
        knee = ratio * self.topk
        if n <= knee:
            work += seen
        else:
            q, r = divmod(knee, ratio)
            work += ratio * q * (q - 1) // 2 + q * (r + 1) + self.topk * (n - knee)
        return work + self.index_weight * seen

    def work(self, uncached_tokens: int, cached_tokens: int) -> float:
        p = cached_tokens
        return self.prefix_work(p + uncached_tokens) - self.prefix_work(p)

    def to_json(self) -> dict[str, Any]:
        return {
            "window": self.window,
            "ratio": self.ratio,
            "topk": self.topk,
            "index_weight": self.index_weight,
        }


CSA = Compressed()
HCA = Compressed(window=128, ratio=128, topk=None, index_weight=0.0)

# A layer's kind: None (full causal), a sliding window in tokens, or Compressed.
LayerKind = int | None | Compressed


def _valid_kind(kind: object) -> bool:
    return kind is None or isinstance(kind, Compressed) or (type(kind) is int and kind >= 1)


def _kind_order(kind: LayerKind) -> tuple[float, ...]:
    """Full layers first, then windows by size, then compressed kinds by ratio."""
    if kind is None:
        return (0,)
    if isinstance(kind, Compressed):
        topk = -1 if kind.topk is None else kind.topk
        return (2, kind.ratio, kind.window, topk, kind.index_weight)
    return (1, kind)


@dataclass(frozen=True)
class AttentionMix:
    """How a model's layers attend: ``groups`` of (share of the layers, kind), the
    kind a sliding window in tokens, None for full causal attention or ``Compressed``;
    shares summing to 1."""

    groups: tuple[tuple[float, LayerKind], ...] = ((1.0, None),)
    # Every layer full causal attention: W is ``attention_work`` (set from ``groups``).
    full: bool = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        groups = tuple((float(f), w) for f, w in self.groups)
        if not (
            groups
            and all(0 < f <= 1 and _valid_kind(w) for f, w in groups)
            and abs(sum(f for f, _ in groups) - 1.0) < 1e-6
        ):
            raise ProfileError(
                "attention groups need shares in (0, 1] summing to 1 and kinds that are "
                f"windows (integers >= 1), None or Compressed, got {self.groups!r}"
            )
        object.__setattr__(self, "groups", groups)
        object.__setattr__(self, "full", all(w is None for _, w in groups))

    def work(self, uncached_tokens: int, cached_tokens: int) -> float:
        """The layers' average W: sum over groups of share * W_kind(R, P)."""
        if self.full:
            return attention_work(uncached_tokens, cached_tokens)
        total = 0.0  # a loop, not sum(): the scheduler calls this per request and worker
        for f, w in self.groups:
            if isinstance(w, Compressed):
                total += f * (
                    w.prefix_work(cached_tokens + uncached_tokens) - w.prefix_work(cached_tokens)
                )
            else:
                total += f * window_work(uncached_tokens, cached_tokens, w)
        return total

    @classmethod
    def of_layers(cls, kinds: Iterable[LayerKind]) -> AttentionMix:
        """The mix of layers of these kinds, one per layer (full layers first, then by
        window, then compressed kinds by ratio)."""
        counts: dict[LayerKind, int] = {}
        for kind in kinds:
            counts[kind] = counts.get(kind, 0) + 1
        n = sum(counts.values())
        order = sorted(counts, key=_kind_order)
        return cls(tuple((counts[k] / n, k) for k in order)) if n else cls()

    @classmethod
    def of_windows(cls, windows: Iterable[int | None]) -> AttentionMix:
        """The mix of layers with these windows (None: full)."""
        return cls.of_layers(windows)

    def to_json(self) -> dict[str, Any]:
        """``[[share, window or null], ...]``; a compressed kind as its fields."""
        return {
            "groups": [[f, w.to_json() if isinstance(w, Compressed) else w] for f, w in self.groups]
        }

    @classmethod
    def from_json(cls, raw: Any, source: str = "profile") -> AttentionMix:
        try:
            groups = tuple(
                (f, Compressed(**w) if isinstance(w, dict) else w) for f, w in raw["groups"]
            )
            return cls(groups)
        except (KeyError, TypeError, ValueError) as exc:
            raise ProfileError(
                f'{source}: "attention" must be {{"groups": [[share, kind], ...]}}, a kind a '
                'window, null or {"window", "ratio", "topk", "index_weight"} '
                f"({exc})"
            ) from None


FULL = AttentionMix()
