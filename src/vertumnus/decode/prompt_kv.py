"""A prompt's KV as it arrived from the prefill pool: pieces in sequence order,
each kept in the layout the wire carried it in (``kv_wire.py``), so that the pull
writes the bytes once and the decode engine's cache takes them with one copy.

    rows piece     K, V [L, t, Hkv, D]         (the tokens no cache block holds, or
                                                blocks read through a rank)
    blocks piece   K, V [m, L, B, Hkv, D]      (m whole blocks of B tokens, as the
                                                pool's paged store keeps them)

``copy_into`` writes every piece into a cache [L, Hkv, capacity, D];
``layers`` gives per-layer K, V [n, Hkv, D] (a copy: for tests and tools). Pure
torch; no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class KVPiece:
    first: int  # the piece's first token
    k: Tensor  # rows: [L, t, Hkv, D]; blocks: [m, L, B, Hkv, D]
    v: Tensor
    blocked: bool

    @property
    def num_tokens(self) -> int:
        return self.k.shape[0] * self.k.shape[2] if self.blocked else self.k.shape[1]

    def as_rows(self) -> tuple[Tensor, Tensor]:
        """K and V [L, t, Hkv, D] (a view of rows, a copy of blocks)."""
        if not self.blocked:
            return self.k, self.v
        return tuple(  # type: ignore[return-value]
            x.permute(1, 0, 2, 3, 4).reshape(x.shape[1], -1, *x.shape[3:]) for x in (self.k, self.v)
        )


@dataclass(frozen=True)
class PromptKV:
    pieces: list[KVPiece]  # in sequence order, contiguous from token 0
    num_tokens: int
    num_layers: int
    num_kv_heads: int
    head_dim: int

    def __post_init__(self) -> None:
        at = 0
        for piece in self.pieces:
            dims = piece.k.shape[-2:] if piece.k.dim() else ()
            layers = piece.k.shape[1] if piece.blocked else piece.k.shape[0]
            if piece.first != at or piece.k.shape != piece.v.shape:
                raise ValueError(f"a KV piece at token {piece.first} (expected {at})")
            if layers != self.num_layers or tuple(dims) != (self.num_kv_heads, self.head_dim):
                raise ValueError(
                    f"a KV piece of {layers} layers, heads and head_dim {tuple(dims)}; expected "
                    f"{self.num_layers} layers, {(self.num_kv_heads, self.head_dim)}"
                )
            at += piece.num_tokens
        if at != self.num_tokens:
            raise ValueError(f"KV pieces of {at} tokens for a prompt KV of {self.num_tokens}")

    @classmethod
    def from_layers(cls, layers: Sequence[tuple[Tensor, Tensor]]) -> PromptKV:
        """From per-layer K, V [n, Hkv, D] (views kept where they can be)."""
        if not layers:
            raise ValueError("prompt KV of no layers")
        k = torch.stack([k for k, _ in layers])  # [L, n, Hkv, D]
        v = torch.stack([v for _, v in layers])
        return cls.from_rows(k, v)

    @classmethod
    def from_rows(cls, k: Tensor, v: Tensor) -> PromptKV:
        """From K, V [L, n, Hkv, D]."""
        if k.dim() != 4:
            raise ValueError(f"prompt KV rows of shape {tuple(k.shape)}: expected [L, n, Hkv, D]")
        layers, n, heads, dim = k.shape
        return cls([KVPiece(0, k, v, False)], n, layers, heads, dim)

    def copy_into(self, k_cache: Tensor, v_cache: Tensor) -> None:
        """Write every piece into caches [L, Hkv, capacity, D] at its positions."""
        for piece in self.pieces:
            t, at = piece.num_tokens, piece.first
            for cache, x in ((k_cache, piece.k), (v_cache, piece.v)):
                dest = cache[:, :, at : at + t]  # [L, Hkv, t, D]
                if piece.blocked:  # [m, L, B, Hkv, D] -> [L, Hkv, m, B, D]
                    m, _, block = x.shape[:3]
                    shape = (dest.shape[0], dest.shape[1], m, block, dest.shape[3])
                    dest.view(shape).copy_(x.permute(1, 3, 0, 2, 4))
                else:  # [L, t, Hkv, D] -> [L, Hkv, t, D]
                    dest.copy_(x.transpose(1, 2))

    def layers(self) -> list[tuple[Tensor, Tensor]]:
        """Per-layer K, V [n, Hkv, D] (copies)."""
        rows = [piece.as_rows() for piece in self.pieces]
        if rows:
            k = torch.cat([r[0] for r in rows], dim=1)
            v = torch.cat([r[1] for r in rows], dim=1)
        else:
            dtype = torch.float32
            k = v = torch.empty((self.num_layers, 0, self.num_kv_heads, self.head_dim), dtype=dtype)
        return [(k[i], v[i]) for i in range(self.num_layers)]
