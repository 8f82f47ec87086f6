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

Prefills here start at position 0 (no cached prefix): a cached prefix of this model
(the window's last rows, the entries, the compressors' open windows) is not kept yet.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from vertumnus.engine.comm import Communicator
from vertumnus.engine.dsv4.compress import attend, index_choice, pool
from vertumnus.engine.dsv4.layers import LayerInputs, rope_tail
from vertumnus.engine.partition import ZigzagPartition

EntryRope = Callable[[Tensor], tuple[Tensor, Tensor]]
QUERY_BLOCK = 128  # query rows attended at once: bounds the [H, b, keys] scores


@dataclass(frozen=True)
class Segment:
    start: int  # suffix index of its first token
    end: int
    local: int  # its first row among this rank's tokens


class DsV4Attention:
    """The attention of every layer of one rank of a degree-C worker, for one prefill
    of ``part.num_tokens`` real tokens from position 0. ``entry_rope(positions)`` gives
    the compress RoPE's cos, sin [n, rd/2] for the compressors' entries; ``topk``: the
    entries the indexer keeps per query."""

    def __init__(
        self, part: ZigzagPartition, comm: Communicator, entry_rope: EntryRope, topk: int
    ) -> None:
        self.part, self.comm = part, comm
        self.entry_rope, self.topk = entry_rope, topk
        s, c = part.chunk_len, part.cp_degree
        self.owner = [min(j, 2 * c - 1 - j) for j in range(2 * c)]
        self.segments: list[Segment] = []
        local = 0
        for a, b in part.ranges(comm.rank):
            self.segments.append(Segment(a, b, local))
            local += b - a
        self.chunk = s

    def __call__(self, layer: int, x: LayerInputs) -> Tensor:
        """This rank's attention output [T, H, D] for layer ``layer``."""
        heads = self._halo(x)
        entries = index_keys = None
        if x.ratio:
            entries, index_keys = self._entries(x, heads)
        outs = []
        for seg, head in zip(self.segments, heads, strict=True):
            outs.append(self._attend_segment(x, seg, head, entries, index_keys))
        return torch.cat(outs) if len(outs) > 1 else outs[0]

    # 1. halo -------------------------------------------------------------------------

    def _tail(self, x: LayerInputs, seg: Segment) -> Tensor:
        """What a segment sends the owner of the next chunk, flat."""
        hi = seg.local + (seg.end - seg.start)
        parts = [x.kv[hi - (x.window - 1) : hi].reshape(-1)]
        if x.ratio and x.compressor is not None and x.compressor.overlap:
            r = x.ratio
            for proj in (x.comp_kv, x.comp_gate, x.index_kv, x.index_gate):
                assert proj is not None
                half = proj.shape[-1] // 2
                parts.append(proj[hi - r : hi, :half].reshape(-1))
        return torch.cat(parts)

    def _halo(self, x: LayerInputs) -> list[Tensor | None]:
        """Per segment, the flat tail of the chunk before it (None at position 0)."""
        comm, size = self.comm, self.comm.size
        sends: list[list[Tensor]] = [[] for _ in range(size)]
        for seg in self.segments:
            if seg.end < self.part.padded_len:
                sends[self.owner[seg.end // self.chunk]].append(self._tail(x, seg))
        width = self._tail_width(x)
        recv = [0] * size
        for seg in self.segments:
            if seg.start > 0:
                recv[self.owner[(seg.start - 1) // self.chunk]] += width
        empty = x.kv.new_zeros(0)
        send = [torch.cat(parts) if parts else empty for parts in sends]
        got = comm.all_to_all(send, recv, tag="halo")
        taken = [0] * size
        heads: list[Tensor | None] = []
        for seg in self.segments:
            if seg.start == 0:
                heads.append(None)
                continue
            q = self.owner[(seg.start - 1) // self.chunk]
            heads.append(got[q][taken[q] : taken[q] + width])
            taken[q] += width
        return heads

    def _tail_width(self, x: LayerInputs) -> int:
        d = x.kv.shape[-1]
        width = (x.window - 1) * d
        if x.ratio and x.compressor is not None and x.compressor.overlap:
            assert x.comp_kv is not None and x.index_kv is not None
            width += 2 * x.ratio * (x.comp_kv.shape[-1] // 2 + x.index_kv.shape[-1] // 2)
        return width

    def _unpack_head(self, x: LayerInputs, head: Tensor) -> tuple[Tensor, list[Tensor]]:
        """A received tail: the raw rows [window - 1, D] and the CSA halves [r, half]."""
        d, r = x.kv.shape[-1], x.ratio
        raw_len = (x.window - 1) * d
        raw = head[:raw_len].view(x.window - 1, d)
        halves, at = [], raw_len
        if x.ratio and x.compressor is not None and x.compressor.overlap:
            for proj in (x.comp_kv, x.comp_gate, x.index_kv, x.index_gate):
                assert proj is not None
                half = proj.shape[-1] // 2
                halves.append(head[at : at + r * half].view(r, half))
                at += r * half
        return raw, halves

    # 2. entries ----------------------------------------------------------------------

    def _entries(self, x: LayerInputs, heads: list[Tensor | None]) -> tuple[Tensor, Tensor | None]:
        """Every entry of the prompt [Rp / r, D] (and the indexer's keys [Rp / r, Di])."""
        comp, r = x.compressor, x.ratio
        assert comp is not None and x.comp_kv is not None and x.comp_gate is not None
        mine, mine_index = [], []
        for seg, head in zip(self.segments, heads, strict=True):
            rows = slice(seg.local, seg.local + (seg.end - seg.start))
            prior = prior_index = None
            if head is not None and comp.overlap:
                _, (ck, cg, ik, ig) = self._unpack_head(x, head)
                half = ck.shape[-1]
                prior = (ck, cg + comp.position_bias[:, :half])
                assert comp.indexer is not None
                prior_index = (ik, ig + comp.indexer.position_bias[:, : ik.shape[-1]])
            first = seg.start // r
            mine.append(self._finish(
                pool(x.comp_kv[rows], x.comp_gate[rows], comp.position_bias, comp.overlap, prior),
                comp.kv_norm, first, r,
            ))  # fmt: skip
            if comp.indexer is not None:
                ix = comp.indexer
                assert x.index_kv is not None and x.index_gate is not None
                pooled = pool(
                    x.index_kv[rows], x.index_gate[rows], ix.position_bias, True, prior_index
                )
                mine_index.append(self._finish(pooled, ix.kv_norm, first, r))
        local = torch.cat(mine)
        d = local.shape[-1]
        flat = [local.reshape(-1)]
        if mine_index:
            flat.append(torch.cat(mine_index).reshape(-1))
        gathered = self.comm.all_gather(torch.cat(flat), tag="comp")  # [C, n]
        per_rank = local.shape[0]
        entries = local.new_empty((self.part.padded_len // r, d))
        keys = None
        if mine_index:
            di = mine_index[0].shape[-1]
            keys = local.new_empty((self.part.padded_len // r, di))
        for rank in range(self.comm.size):
            row = gathered[rank]
            ent = row[: per_rank * d].view(per_rank, d)
            idx = row[per_rank * d :].view(per_rank, -1) if keys is not None else None
            at = 0
            for a, b in self.part.ranges(rank):
                n = (b - a) // r
                entries[a // r : b // r] = ent[at : at + n]
                if keys is not None and idx is not None:
                    keys[a // r : b // r] = idx[at : at + n]
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
        head: Tensor | None,
        entries: Tensor | None,
        index_keys: Tensor | None,
    ) -> Tensor:
        n_seg = seg.end - seg.start
        rows = slice(seg.local, seg.local + n_seg)
        raw = x.kv[rows]
        halo = 0
        if head is not None:
            halo_rows, _ = self._unpack_head(x, head)
            raw = torch.cat((halo_rows, raw))
            halo = halo_rows.shape[0]
        key_pos = torch.arange(seg.start - halo, seg.end, device=raw.device)
        real_entries = self.part.num_tokens // x.ratio if x.ratio else 0
        out = []
        for lo in range(0, n_seg, QUERY_BLOCK):
            hi = min(lo + QUERY_BLOCK, n_seg)
            qpos = torch.arange(seg.start + lo, seg.start + hi, device=raw.device)
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
