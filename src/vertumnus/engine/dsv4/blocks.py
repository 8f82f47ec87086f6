"""DeepSeek-V4's prefix state in the pool's paged blocks: what a block of ``B`` tokens
keeps so that a prefill resumes a prefix of whole blocks exactly, how a prefill writes
its blocks (``BlockWriter``) and how a later one reads them (``read_prefix``). It does
not decide which slot holds which block (the worker's cache index) nor move blocks
between ranks, workers or the host tier (they move slots whatever is in them).

Why blocks of a multiple of 128 tokens (``DeepseekV4Spec.block_problem``): 128 is the
sliding window and the longest compression window (HCA's). A block then holds whole
windows of every compressor, so a prefix of whole blocks leaves no window open; the
raw rows a query after it still sees (the window's last 127) lie in its last block;
and its end is a chunk boundary of every zigzag partition, which is where CP resumes.

A block's facts, per layer, in the slot geometry every model has (K and V of
[B, 1, D] per layer), so copies, reshapes, the host tier and reads move them as they
move any block::

    K  | mark | zeros                   | its last window - 1 raw rows (K = V)   |
    V  | entries [B/r, D] | index keys [B/r, Di] | Ca halves of its last window:  |
       | comp kv [r, D], gate [r, D], index kv [r, Di], gate [r, Di] | zeros     |

(CSA; HCA keeps its entries alone in V, a sliding layer nothing). The raw rows and
the Ca halves are what a resume needs of the prefix's last block alone.

Writing moves nothing between ranks. A block's entries and keys are on every rank
after the ``comp`` all-gathers; its raw rows are on the rank that computed the chunk
it ends in, which stores it one time in C (depth ``d`` lives on CP rank ``d % C``).
That rank keeps them and marks the block (``keeps_raw_rows``); the others store the
entries and keys alone. (Carrying every block's raw rows to the rank storing it
would cost a rank ``(C-1)/C^2`` of the prompt's rows per layer: 1/C of an all-gather
of the raw KV, more than all of the prefill's own exchanges at C <= 4.)

Reading: one ``prefix`` all-gather brings every rank the marks and V facts of the
prefix's blocks and, from each rank, the raw rows of its last marked block. The state
resumes at the end of the last marked block; the prefix's tokens after it (about C
blocks at most for a prompt written in one prefill) are computed again with the
suffix (``model.command_rank``), which is why a V4 command carries its prefix's token
ids.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from vertumnus.engine.comm import Communicator
from vertumnus.engine.dsv4.state import DsV4State, LayerState
from vertumnus.engine.kv_store import PagedKVStore

if TYPE_CHECKING:
    from vertumnus.engine.dsv4.model import DeepseekV4LM


@dataclass(frozen=True)
class Layout:
    """One layer's facts in a block of ``block`` tokens."""

    ratio: int  # 0: sliding only
    d: int  # head dim (the shared K = V)
    di: int  # the indexer's key dim (CSA), else 0
    window: int
    block: int

    @property
    def num_entries(self) -> int:
        return self.block // self.ratio if self.ratio else 0

    @property
    def halves(self) -> tuple[int, ...]:
        """Widths of the Ca halves CSA keeps of a window: comp kv, gate, index kv, gate."""
        return (self.d, self.d, self.di, self.di) if self.di else ()

    @property
    def raw_numel(self) -> int:
        return (self.window - 1) * self.d

    @property
    def tail_numel(self) -> int:
        """The rows ``DsV4Attention._tail`` gives: raw, then the Ca halves."""
        return self.raw_numel + self.ratio * sum(self.halves)

    @property
    def facts_numel(self) -> int:
        """What V holds: entries, keys, Ca halves."""
        return self.num_entries * (self.d + self.di) + self.ratio * sum(self.halves)


def layouts(model: DeepseekV4LM, block: int) -> list[Layout]:
    """Every layer's ``Layout`` (ValueError for a block size that cannot hold them)."""
    why = model.config.block_cache_problem(block)
    if why is not None:
        raise ValueError(why)
    out = []
    for layer in model.decoder_layers():
        attn = layer.self_attn
        comp = attn.compressor
        di = 0
        if comp is not None and comp.indexer is not None:
            di = comp.indexer.kv_norm.weight.shape[0]
        out.append(Layout(attn.ratio, attn.head_dim, di, attn.window, block))
    return out


def _split(flat: Tensor, sizes: Sequence[int]) -> list[Tensor]:
    out, at = [], 0
    for n in sizes:
        out.append(flat[at : at + n])
        at += n
    return out


def _marks(store: PagedKVStore, slots: Tensor) -> Tensor:
    """[len(slots), 1] the blocks' marks: the first value of their first layer's K,
    a row the raw rows never reach (``window - 1 < B``); nonzero where the block
    keeps its raw rows (and CSA halves)."""
    return store.k[slots, 0, 0].reshape(len(slots), -1)[:, :1]


def keeps_raw_rows(store: PagedKVStore, slot: int) -> bool:
    """Whether the block in ``slot`` keeps its raw rows (and CSA halves)."""
    return bool(_marks(store, torch.tensor([slot], device=store.k.device)).item())


class BlockWriter:
    """Stores one rank's new full blocks of one prefill, ``writes`` ((depth, slot)),
    layer by layer as the attention computes the layer (``zigzag.DsV4Attention``):
    every block's entries and keys, and the raw rows and CSA halves of the blocks this
    rank computed, marked (``keeps_raw_rows``). Nothing is kept from one layer to the
    next, and nothing crosses ranks."""

    def __init__(
        self,
        model: DeepseekV4LM,
        store: PagedKVStore,
        writes: Sequence[tuple[int, int]],
        offset: int,
    ) -> None:
        b = store.block_size
        self.store, self.lays = store, layouts(model, b)
        self.depths = [d for d, _ in writes]
        self.slots = [s for _, s in writes]
        # Where each block ends, as an index of the tokens computed after ``offset``.
        self.ends = tuple((d + 1) * b - offset for d in self.depths)

    def layer(
        self, i: int, tails: dict[int, Tensor], entries: Tensor | None, keys: Tensor | None
    ) -> None:
        """Store layer ``i`` of the blocks: ``tails`` (``DsV4Attention._tail`` by block
        end) of those this rank computed; ``entries``, ``keys``: every entry (and
        indexer key) of the prompt so far."""
        store, lay, b = self.store, self.lays[i], self.store.block_size
        n, w = len(self.slots), lay.window - 1
        k = store.k.new_zeros((n * b, *store.k.shape[3:]))
        v = store.v.new_zeros((n * b, *store.v.shape[3:]))
        for j, (d, end) in enumerate(zip(self.depths, self.ends, strict=True)):
            facts = []
            if entries is not None and lay.ratio:
                rows = slice(d * b // lay.ratio, (d + 1) * b // lay.ratio)
                facts.append(entries[rows].reshape(-1))
                if keys is not None:
                    facts.append(keys[rows].reshape(-1))
            if end in tails:
                raw, prior = _split(tails[end], (lay.raw_numel, lay.tail_numel - lay.raw_numel))
                k[(j + 1) * b - w : (j + 1) * b] = raw.view(w, *k.shape[1:])
                facts.append(prior)
                if i == 0:
                    k[j * b].view(-1)[0] = 1.0  # the mark
            if facts:
                flat = torch.cat(facts)
                v[j * b : (j + 1) * b].view(-1)[: flat.numel()] = flat
        store.write(self.slots, i, k, v)


def read_prefix(
    model: DeepseekV4LM,
    store: PagedKVStore,
    comm: Communicator,
    slots: Sequence[int],
    prefix_len: int,
) -> DsV4State | None:
    """The state of the longest part of a cached prefix of ``prefix_len`` tokens
    (whole blocks; block ``d`` on CP rank ``d % C``, this rank's in ``slots``, its
    depths in order) that ends on a block keeping its raw rows; None when none does
    (the prefix is then computed again from its first token). One ``prefix``
    all-gather: every rank's blocks' marks and V facts, and the raw rows of its last
    marked block."""
    b, me, size = store.block_size, comm.rank, comm.size
    lays = layouts(model, b)
    if prefix_len <= 0 or prefix_len % b:
        raise ValueError(f"a cached prefix of {prefix_len} tokens is not whole {b}-token blocks")
    n = prefix_len // b
    if len(slots) != len(range(me, n, size)):
        raise ValueError("prefix slots do not match this rank's share of the prefix")
    facts = [lay.facts_numel for lay in lays]
    per_block, most = 1 + sum(facts), len(range(0, n, size))
    row = store.v.new_zeros(most * per_block + sum(lay.raw_numel for lay in lays))
    if slots:
        # This rank's blocks, read at once: [blocks, 1 (mark) + every layer's facts].
        idx = torch.as_tensor(list(slots), dtype=torch.long, device=store.v.device)
        marks = _marks(store, idx)
        mine = [store.v[idx, i].reshape(len(slots), -1)[:, :f] for i, f in enumerate(facts)]
        row[: len(slots) * per_block] = torch.cat([marks, *mine], dim=1).reshape(-1)
        marked_here = [j for j, m in enumerate(marks.flatten().tolist()) if m]
        if marked_here:  # its last marked block's raw rows
            last = slots[marked_here[-1]]
            tails = [store.k[last, i, b - (lay.window - 1) :] for i, lay in enumerate(lays)]
            row[most * per_block :] = torch.cat([t.reshape(-1) for t in tails])
    rows = comm.all_gather(row, tag="prefix")  # [C, most * per_block + raw]
    by_rank = rows[:, : most * per_block].view(size, most, per_block)

    def block(d: int) -> Tensor:
        return by_rank[d % size, d // size]

    every = by_rank[:, :, 0].tolist()  # the marks, [rank][its j-th block]
    marked = [d for d in range(n) if every[d % size][d // size]]
    if not marked:
        return None
    n = marked[-1] + 1
    raws = _split(rows[(n - 1) % size, most * per_block :], [lay.raw_numel for lay in lays])
    blocks = [_split(block(d)[1:], facts) for d in range(n)]
    layers = []
    for i, lay in enumerate(lays):
        raw = raws[i].view(lay.window - 1, lay.d).clone()
        if not lay.ratio:
            layers.append(LayerState(raw))
            continue
        e = lay.num_entries
        sizes = (e * lay.d, e * lay.di, lay.facts_numel - e * (lay.d + lay.di))
        parts = [_split(blocks[d][i], sizes) for d in range(n)]
        entries = torch.cat([part[0].view(e, lay.d) for part in parts])
        keys = torch.cat([part[1].view(e, lay.di) for part in parts]) if lay.di else None
        prior = []
        if lay.di:
            flat = _split(parts[-1][2], [lay.ratio * h for h in lay.halves])
            prior = [t.view(lay.ratio, h).clone() for t, h in zip(flat, lay.halves, strict=True)]
        layers.append(LayerState(raw, entries, keys, [], prior))
    return DsV4State(n * b, layers)
