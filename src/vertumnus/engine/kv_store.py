"""Paged KV blocks on one rank.

Owns the KV tensors of one rank: ``num_blocks`` slots, each holding K and V of
``block_size`` tokens for every layer. It does not decide which slot holds which
block: the worker's cache index (``policy/cache/index.py``) allocates slots and the
prefill command names them; this store only reads and writes.

Layout: ``k``, ``v``: [num_blocks, num_layers, block_size, Hkv, D].

On the CPU the two tensors may live in one shared-memory segment that the
coordinator made (``runtime/kv/segments.py``: ``k`` first, then ``v``): the
coordinator then streams a hand-off's blocks straight from it, without asking
this rank. The segment outlives a restart of the rank; its contents then mean
nothing until written again (the worker's index starts empty).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from multiprocessing import shared_memory

import torch
from torch import Tensor

from vertumnus.config import ModelConfig


class PagedKVStore:
    def __init__(
        self,
        cfg: ModelConfig,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
        segment: str | None = None,
    ) -> None:
        shape = store_shape(cfg, num_blocks, block_size)
        self._shm: shared_memory.SharedMemory | None = None
        if segment is not None:
            if device.type != "cpu":
                raise ValueError(f"a shared-memory KV store is on the CPU, not {device}")
            self._shm = shared_memory.SharedMemory(name=segment)
            buf = self._shm.buf
            assert buf is not None  # None only once the segment is closed
            self.k, self.v = store_tensors(buf, shape, dtype)
        else:
            self.k = torch.zeros(shape, dtype=dtype, device=device)
            self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.num_blocks = shape[0]
        self.block_size = block_size

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def _check(self, slots: Sequence[int]) -> None:
        bad = [s for s in slots if not 0 <= s < self.num_blocks]
        if bad:
            raise IndexError(f"KV slots {bad} out of range [0, {self.num_blocks})")

    def read(self, slots: Sequence[int], layer: int) -> tuple[Tensor, Tensor]:
        """K, V of ``slots`` (in that order) at ``layer``: [len(slots) * block_size, Hkv, D]."""
        self._check(slots)
        idx = torch.as_tensor(list(slots), dtype=torch.long, device=self.k.device)
        k = self.k[idx, layer]
        v = self.v[idx, layer]
        return k.flatten(0, 1), v.flatten(0, 1)

    def write(self, slots: Sequence[int], layer: int, k: Tensor, v: Tensor) -> None:
        """Store ``k``, ``v`` [len(slots) * block_size, Hkv, D] into ``slots`` at ``layer``."""
        self._check(slots)
        if not slots:
            return
        idx = torch.as_tensor(list(slots), dtype=torch.long, device=self.k.device)
        n = len(slots)
        self.k[idx, layer] = k.reshape(n, self.block_size, *k.shape[1:]).to(self.k.dtype)
        self.v[idx, layer] = v.reshape(n, self.block_size, *v.shape[1:]).to(self.v.dtype)

    def export(self, slots: Sequence[int]) -> tuple[Tensor, Tensor]:
        """K, V of ``slots`` over all layers: [len(slots), layers, block_size, Hkv, D]."""
        self._check(slots)
        idx = torch.as_tensor(list(slots), dtype=torch.long, device=self.k.device)
        return self.k[idx].cpu(), self.v[idx].cpu()

    def rows(self, slots: Sequence[int]) -> Tensor:
        """K and V of ``slots`` as token rows, in slot order: [2, layers,
        len(slots) * block_size, Hkv, D] (one copy; a hand-off's blocks)."""
        self._check(slots)
        idx = torch.as_tensor(list(slots), dtype=torch.long, device=self.k.device)
        out = torch.stack((self.k[idx], self.v[idx]))  # [2, n, layers, B, Hkv, D]
        return out.transpose(1, 2).flatten(2, 3)

    def rows_into(self, slots: Sequence[int], out: Tensor, rows_at: Sequence[int]) -> None:
        """Write the blocks of ``slots`` into ``out`` [2, layers, rows, Hkv, D], slot
        i's block at rows ``rows_at[i]`` onwards (each a multiple of the block size).
        Offsets in arithmetic progression (a CP rank's share of a run of blocks: every
        C-th block) take one gather per layer straight into ``out``; others, two
        copies."""
        self._check(slots)
        bs = self.block_size
        if len(slots) != len(rows_at) or any(a % bs for a in rows_at):
            raise ValueError("one row offset per slot, each a multiple of the block size")
        if not slots:
            return
        idx = torch.as_tensor(list(slots), dtype=torch.long, device=self.k.device)
        pos = [a // bs for a in rows_at]
        blocks = out.view(2, out.shape[1], out.shape[2] // bs, bs, *out.shape[3:])
        step = pos[1] - pos[0] if len(pos) > 1 else 1
        if step > 0 and all(b - a == step for a, b in itertools.pairwise(pos)):
            span = slice(pos[0], pos[-1] + 1, step)
            for kv, store in enumerate((self.k, self.v)):
                for layer in range(store.shape[1]):
                    dst = blocks[kv, layer, span]
                    if store.device == out.device:
                        torch.index_select(store[:, layer], 0, idx, out=dst)
                    else:
                        dst.copy_(store[:, layer].index_select(0, idx))
            return
        where = torch.as_tensor(pos, dtype=torch.long, device=out.device)
        for kv, store in enumerate((self.k, self.v)):
            picked = store.index_select(0, idx).to(out.device)  # [n, layers, B, Hkv, D]
            blocks[kv].index_copy_(1, where, picked.transpose(0, 1))

    def install(self, slots: Sequence[int], k: Tensor, v: Tensor) -> None:
        """Store blocks exported by ``export`` (of another rank) into ``slots``."""
        self._check(slots)
        if k.shape != (len(slots), *self.k.shape[1:]) or v.shape != k.shape:
            raise ValueError(
                f"KV of shape {tuple(k.shape)} does not fit {len(slots)} slots of "
                f"{tuple(self.k.shape[1:])}"
            )
        idx = torch.as_tensor(list(slots), dtype=torch.long, device=self.k.device)
        self.k[idx] = k.to(self.k.device, self.k.dtype)
        self.v[idx] = v.to(self.v.device, self.v.dtype)


def store_shape(cfg: ModelConfig, num_blocks: int, block_size: int) -> tuple[int, ...]:
    """The shape of a store's K (and of its V): one block for a model whose prefixes
    the pool does not cache at this block size (DeepSeek-V4 at a block size not a
    multiple of 128: no block is ever written, and at its size ``kv_blocks_per_rank``
    unused blocks would be gigabytes). DeepSeek-V4's blocks have this shape too, with
    its own layout inside (``engine/dsv4/blocks.py``)."""
    blocks = num_blocks if cfg.caches_prefixes(block_size) else 1
    return (blocks, cfg.num_hidden_layers, block_size, cfg.num_key_value_heads, cfg.head_dim)


def store_tensors(
    buffer: memoryview, shape: tuple[int, ...], dtype: torch.dtype
) -> tuple[Tensor, Tensor]:
    """K and V of a store laid out in ``buffer`` (K, then V), without a copy; the
    buffer must outlive them."""
    count = math.prod(shape)
    both = torch.frombuffer(buffer, dtype=dtype, count=2 * count)
    return both[:count].view(shape), both[count:].view(shape)
