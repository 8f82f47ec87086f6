"""Zigzag CP for DeepSeek-V4, partitioned: each rank compresses its own windows and
exchanges the compressed entries and a window's halo, never the raw KV of the prompt.

The suffix is padded to a multiple of 2C x ``align`` (the longest compression window,
128, which is also the sliding window), so every chunk holds whole windows of every
compressor and a chunk's halo lies in the chunk before it. Rank k owns chunks k and
2C-1-k (``partition.py``); a *segment* is one of its ranges (rank C-1's two chunks are
one). Per layer:

1. **halo** (an all-to-all, every layer): each segment sends the rank owning the next
   chunk its last ``window - 1`` shared-KV rows and, for a CSA layer, the first half of
   the channels of its last window's compressor and indexer projections (the next
   window's entry pools them). What crosses is ``(window - 1) x D`` values per chunk
   boundary, plus ``4 x 2 (D + Di)`` for CSA.
2. **comp** (an all-gather, compressed layers only): each rank pools the windows of its
   segments and gathers everyone's entries (CSA: an entry of D and an indexer key of
   Di per 4 tokens; HCA: an entry of D per 128 tokens).
3. Each query block attends over its window (its segment's rows and the halo) and the
   entries it sees (``compress.py``). No collective.

So a rank receives per compressed layer about ``(C-1)/C x L/4 x (D + Di)`` values for
CSA and ``(C-1)/C x L/128 x D`` for HCA, against ``(C-1)/C x L x D`` for an all-gather
of the raw KV (``tools/bench/dsv4_cp.py`` measures both). After the last layer the
final hidden states are all-gathered once (``out``), as for every model.

A prefill may resume a prompt's ``DsV4State`` (``state.py``: a cached prefix, or the
tokens a decode server has seen): its raw rows are the first segment's halo, its
entries come before the new ones, and at C = 1 its open windows are pooled with the
new rows (under CP the prefix must end on a chunk boundary: ``align``). At C = 1 the
prefill also returns the state after its tokens (the decode engine's step).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from vertumnus.engine.comm import Communicator
from vertumnus.engine.dsv4.blocks import BlockWriter
from vertumnus.engine.dsv4.compress import attend, index_choice, pool
from vertumnus.engine.dsv4.layers import LayerInputs, rope_tail
from vertumnus.engine.dsv4.state import DsV4State, Head, LayerState, advance
from vertumnus.engine.partition import ZigzagPartition

EntryRope = Callable[[Tensor], tuple[Tensor, Tensor]]
QUERY_BLOCK = 128  # query rows attended at once: bounds the [H, b, keys] scores


@dataclass(frozen=True)
class Segment:
    start: int  # suffix index of its first token
    end: int
    local: int  # its first row among this rank's tokens


def _projections(x: LayerInputs) -> list[Tensor]:
    """The compressor's rows a window pools: kv, gate (and the indexer's)."""
    rows = [x.comp_kv, x.comp_gate, x.index_kv, x.index_gate]
    return [t for t in rows if t is not None]


class DsV4Attention:
    """The attention of every layer of one rank of a degree-C worker, for one prefill
    of ``part.num_tokens`` tokens after ``prefix`` (None: from position 0).
    ``entry_rope(positions)`` gives the compress RoPE's cos, sin [n, rd/2] for the
    compressors' entries; ``topk``: the entries the indexer keeps per query. At C = 1
    ``states`` collects the state after the prefill, layer by layer."""

    def __init__(
        self,
        part: ZigzagPartition,
        comm: Communicator,
        entry_rope: EntryRope,
        topk: int,
        prefix: DsV4State | None = None,
        keep_state: bool = False,
        state_at: int | None = None,
        writer: BlockWriter | None = None,
    ) -> None:
        self.part, self.comm, self.keep_state = part, comm, keep_state
        # Stores this rank's new blocks layer by layer (``blocks.py``): given each
        # layer's entries and the tails of the blocks ending in this rank's segments.
        self.writer = writer
        # The state kept is the prompt's after its first ``state_at`` new tokens.
        self.state_at = part.num_tokens if state_at is None else state_at
        if not 0 < self.state_at <= part.num_tokens:
            raise ValueError(f"state_at {state_at} outside the {part.num_tokens} new tokens")
        self.entry_rope, self.topk, self.prefix = entry_rope, topk, prefix
        self.offset = 0 if prefix is None else prefix.length
        if comm.size > 1 and self.offset % part.align:
            raise ValueError(
                f"a prefix of {self.offset} tokens does not end on a {part.align}-token "
                "boundary, which CP needs"
            )
        c = part.cp_degree
        self.owner = [min(j, 2 * c - 1 - j) for j in range(2 * c)]
        self.segments: list[Segment] = []
        local = 0
        for a, b in part.ranges(comm.rank):
            self.segments.append(Segment(a, b, local))
            local += b - a
        self.chunk = part.chunk_len
        self.states: list[LayerState] = []
        # Under CP with ``keep_state``: per layer, the rows of the state's span this rank
        # computed (zeros elsewhere) and every entry so far (``model.resume_rank``).
        end = self.offset + self.state_at
        self.span_start = max(self.offset, end // part.align * part.align - part.align)
        self.spans: list[Tensor] = []
        self.widths: list[list[int]] = []
        self.kept: list[tuple[Tensor | None, Tensor | None]] = []

    def __call__(self, layer: int, x: LayerInputs) -> Tensor:
        """This rank's attention output [T, H, D] for layer ``layer``."""
        heads = self._halo(x)
        if self.prefix is not None:
            heads[0] = self.prefix.layers[layer].head() if heads[0] is None else heads[0]
        entries = index_keys = None
        if x.ratio:
            entries, index_keys = self._entries(layer, x, heads)
        outs = [
            self._attend_segment(x, seg, head, entries, index_keys)
            for seg, head in zip(self.segments, heads, strict=True)
        ]
        if self.writer is not None:
            self.writer.layer(layer, self._block_tails(x, self.writer.ends), entries, index_keys)
        if self.comm.size == 1:
            self.states.append(self._state_after(x, heads[0], entries, index_keys))
        elif self.keep_state:
            self.spans.append(self._span(x))
            self.widths.append([t.shape[1] for t in _projections(x)])
            self.kept.append((entries, index_keys))
        return torch.cat(outs) if len(outs) > 1 else outs[0]

    # 1. halo -------------------------------------------------------------------------

    def _tail(self, x: LayerInputs, hi: int) -> Tensor:
        """The window's tail before local row ``hi`` (a window boundary), flat: the
        last raw rows and, for CSA, the Ca halves of the last window. A segment sends
        its own to the owner of the next chunk; a stored block keeps its own."""
        parts = [x.kv[hi - (x.window - 1) : hi].reshape(-1)]
        if self._csa(x):
            for proj in _projections(x):
                parts.append(proj[hi - x.ratio : hi, : proj.shape[-1] // 2].reshape(-1))
        return torch.cat(parts)

    @staticmethod
    def _csa(x: LayerInputs) -> bool:
        return x.compressor is not None and x.compressor.overlap

    def _halo(self, x: LayerInputs) -> list[Head | None]:
        """Per segment, what the chunk before it sends (None at the suffix's start)."""
        comm, size = self.comm, self.comm.size
        sends: list[list[Tensor]] = [[] for _ in range(size)]
        for seg in self.segments:
            if seg.end < self.part.padded_len:
                hi = seg.local + (seg.end - seg.start)
                sends[self.owner[seg.end // self.chunk]].append(self._tail(x, hi))
        d = x.kv.shape[-1]
        halves = [p.shape[-1] // 2 for p in _projections(x)] if self._csa(x) else []
        width = (x.window - 1) * d + x.ratio * sum(halves)
        recv = [0] * size
        for seg in self.segments:
            if seg.start > 0:
                recv[self.owner[(seg.start - 1) // self.chunk]] += width
        empty = x.kv.new_zeros(0)
        got = comm.all_to_all([torch.cat(p) if p else empty for p in sends], recv, tag="halo")
        taken = [0] * size
        heads: list[Head | None] = []
        for seg in self.segments:
            if seg.start == 0:
                heads.append(None)
                continue
            q = self.owner[(seg.start - 1) // self.chunk]
            flat = got[q][taken[q] : taken[q] + width]
            taken[q] += width
            at = (x.window - 1) * d
            prior = []
            for half in halves:
                prior.append(flat[at : at + x.ratio * half].view(x.ratio, half))
                at += x.ratio * half
            heads.append(Head(flat[: (x.window - 1) * d].view(x.window - 1, d), prior))
        return heads

    def _block_tails(self, x: LayerInputs, ends: tuple[int, ...]) -> dict[int, Tensor]:
        """The tails (``_tail``) of the blocks ending at suffix indices ``ends`` that
        end in this rank's segments (those it computed)."""
        out = {}
        for end in ends:
            for seg in self.segments:
                if seg.start < end <= seg.end:
                    out[end] = self._tail(x, seg.local + (end - seg.start))
        return out

    # 2. entries ----------------------------------------------------------------------

    def _pool_segment(
        self, x: LayerInputs, seg: Segment, head: Head | None
    ) -> tuple[Tensor, Tensor | None]:
        """The entries (and indexer keys) of a segment's whole windows, with the open
        window before it (a state's, C = 1) in front."""
        comp, r = x.compressor, x.ratio
        assert comp is not None
        rows = slice(seg.local, seg.local + (seg.end - seg.start))
        proj = [t[rows] for t in _projections(x)]
        first = self.offset + seg.start
        if head is not None and head.open:
            proj = [torch.cat(pair) for pair in zip(head.open, proj, strict=True)]
            first -= head.open[0].shape[0]
        whole = proj[0].shape[0] // r * r
        proj = [t[:whole] for t in proj]
        biases = [comp.position_bias]
        if comp.indexer is not None:
            biases.append(comp.indexer.position_bias)
        prior: list[tuple[Tensor, Tensor] | None] = [None, None]
        if head is not None and head.prior:
            for i, bias in enumerate(biases):
                kv, gate = head.prior[2 * i], head.prior[2 * i + 1]
                prior[i] = (kv, gate + bias[:, : gate.shape[-1]])
        entries = self._finish(
            pool(proj[0], proj[1], comp.position_bias, comp.overlap, prior[0]),
            comp.kv_norm, first // r, r,
        )  # fmt: skip
        keys = None
        if comp.indexer is not None:
            ix = comp.indexer
            pooled = pool(proj[2], proj[3], ix.position_bias, True, prior[1])
            keys = self._finish(pooled, ix.kv_norm, first // r, r)
        return entries, keys

    def _entries(
        self, layer: int, x: LayerInputs, heads: list[Head | None]
    ) -> tuple[Tensor, Tensor | None]:
        """Every entry of the prompt so far [n, D] (and the indexer's keys [n, Di])."""
        mine = [self._pool_segment(x, seg, h) for seg, h in zip(self.segments, heads, strict=True)]
        local = torch.cat([e for e, _ in mine])
        keyed = mine[0][1] is not None
        if self.comm.size == 1:
            keys = torch.cat([k for _, k in mine if k is not None]) if keyed else None
            entries = local
        else:
            keys_mine = [k for _, k in mine if k is not None] if keyed else None
            entries, keys = self._gather(local, keys_mine, x.ratio)
        if self.prefix is not None:
            old = self.prefix.layers[layer]
            assert old.entries is not None
            entries = torch.cat((old.entries, entries))
            if keys is not None and old.index_keys is not None:
                keys = torch.cat((old.index_keys, keys))
        return entries, keys

    def _gather(
        self, local: Tensor, local_keys: list[Tensor] | None, ratio: int
    ) -> tuple[Tensor, Tensor | None]:
        """Every rank's new entries in sequence order (``comp``: one all-gather)."""
        d = local.shape[-1]
        flat = [local.reshape(-1)]
        if local_keys is not None:
            flat.append(torch.cat(local_keys).reshape(-1))
        gathered = self.comm.all_gather(torch.cat(flat), tag="comp")  # [C, n]
        per_rank = local.shape[0]
        entries = local.new_empty((self.part.padded_len // ratio, d))
        keys = None
        if local_keys is not None:
            keys = local.new_empty((entries.shape[0], (gathered.shape[1] // per_rank) - d))
        for rank in range(self.comm.size):
            row, at = gathered[rank], 0
            ent = row[: per_rank * d].view(per_rank, d)
            for a, b in self.part.ranges(rank):
                n = (b - a) // ratio
                entries[a // ratio : b // ratio] = ent[at : at + n]
                if keys is not None:
                    idx = row[per_rank * d :].view(per_rank, -1)
                    keys[a // ratio : b // ratio] = idx[at : at + n]
                at += n
        return entries, keys

    def _finish(self, pooled: Tensor, norm: torch.nn.Module, first: int, r: int) -> Tensor:
        """Normed entries at window positions ``(first + i) * r``, RoPE applied."""
        n = pooled.shape[0]
        positions = (torch.arange(n, device=pooled.device) + first) * r
        cos, sin = self.entry_rope(positions)
        normed = norm(pooled)
        out: Tensor = rope_tail(normed[:, None], cos.to(normed.dtype), sin.to(normed.dtype))[:, 0]
        return out

    # 3. attention --------------------------------------------------------------------

    def _attend_segment(
        self,
        x: LayerInputs,
        seg: Segment,
        head: Head | None,
        entries: Tensor | None,
        index_keys: Tensor | None,
    ) -> Tensor:
        n_seg, p = seg.end - seg.start, self.offset
        raw = x.kv[seg.local : seg.local + n_seg]
        halo = 0
        if head is not None and head.raw.shape[0]:
            raw = torch.cat((head.raw, raw))
            halo = head.raw.shape[0]
        key_pos = torch.arange(p + seg.start - halo, p + seg.end, device=raw.device)
        real_entries = (p + self.part.num_tokens) // x.ratio if x.ratio else 0
        out = []
        for lo in range(0, n_seg, QUERY_BLOCK):
            hi = min(lo + QUERY_BLOCK, n_seg)
            qpos = torch.arange(p + seg.start + lo, p + seg.start + hi, device=raw.device)
            # Raw keys the block may see: from (its first query - window + 1) to its last.
            k0 = max(0, lo + halo - (x.window - 1))
            keys, kp = raw[k0 : hi + halo], key_pos[k0 : hi + halo]
            delta = qpos[:, None] - kp[None, :]
            raw_seen = (delta >= 0) & (delta < x.window)
            ent = seen = None
            if x.ratio and entries is not None:
                ent = entries[:real_entries]
                if index_keys is not None:
                    assert x.index_q is not None and x.index_w is not None
                    qi = slice(seg.local + lo, seg.local + hi)
                    seen = index_choice(x.index_q[qi], x.index_w[qi], index_keys[:real_entries],
                                        qpos, x.ratio, self.topk)  # fmt: skip
                else:
                    idx = torch.arange(real_entries, device=raw.device)
                    seen = idx[None, :] < ((qpos + 1) // x.ratio)[:, None]
            q = x.q[seg.local + lo : seg.local + hi]
            out.append(attend(q, keys, raw_seen, ent, seen, x.sinks))
        return torch.cat(out)

    # the state after ---------------------------------------------------------------

    def _span(self, x: LayerInputs) -> Tensor:
        """[2 align, D + W] the raw and projection rows of positions ``span_start`` ..
        the prompt's end that this rank computed; zeros in the others' rows."""
        rows = torch.cat([x.kv, *_projections(x)], dim=1)
        out = rows.new_zeros((2 * self.part.align, rows.shape[1]))
        first = self.span_start - self.offset  # suffix index of the span's first row
        for seg in self.segments:
            a, b = max(seg.start, first), min(seg.end, self.state_at)
            if a < b:
                local = seg.local + (a - seg.start)
                out[a - first : b - first] = rows[local : local + (b - a)]
        return out

    def _state_after(
        self,
        x: LayerInputs,
        head: Head | None,
        entries: Tensor | None,
        index_keys: Tensor | None,
    ) -> LayerState:
        n, d = self.state_at, x.kv.shape[-1]
        before = head if head is not None else Head(x.kv.new_zeros((0, d)))
        rows = [t[:n] for t in _projections(x)]
        real = (self.offset + n) // x.ratio if x.ratio else 0
        seen = (
            None if entries is None else entries[:real],
            None if index_keys is None else index_keys[:real],
        )
        return advance(before, rows, x.kv[:n], x.ratio, x.window, seen)
