"""Zigzag context-parallel prefill: partition, attention, restore.

Owns how each rank of a worker attends over the cached prefix and the causally
visible suffix. It does not own the partition (``partition.py``), communication
(``comm.py``), a sliding window's halo plan (``halo.py``), the model (``model.py``)
or slot allocation (``policy/cache/index.py``).

Partition (docs/architecture.md, "Zigzag CP prefill"). The suffix of R tokens is
padded to Rp = 2C * s tokens, s = ceil(R / 2C), and cut into 2C chunks of s tokens;
rank k owns chunks k and 2C-1-k, which balances causal attention work::

    C = 2, chunks:   | 0 | 1 | 2 | 3 |      rank 0: chunks 0, 3
                                            rank 1: chunks 1, 2

Padding sits at the end of the suffix, after every real token, so causal masking
alone keeps it out of every real query's view; outputs of padded queries are dropped.

Per layer, each rank packs [its share of the cached prefix blocks, padded to the
largest share | its suffix K/V] and issues exactly one collective. A full-attention
layer all-gathers (tag ``kv``): every rank then holds the whole prefix and suffix
K/V in sequence order. A sliding-window layer exchanges its halo instead (one
all-to-all, tag ``halo``): each rank receives only the rows its queries see within
the window and the rows of the blocks it stores. Either way each rank keeps the K/V
of the new full blocks assigned to it for the cache. Sinks join every query's
softmax on its own rank (the rank sees every key its query sees), so they are exact.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from vertumnus.engine.attention import prefix_causal_attention, windowed_attention
from vertumnus.engine.comm import Communicator
from vertumnus.engine.halo import HaloPlan, plan_halo
from vertumnus.engine.kv_store import PagedKVStore
from vertumnus.engine.logprobs import PromptLogprobs, prompt_logprobs
from vertumnus.engine.model import CausalLM
from vertumnus.engine.partition import ZigzagPartition as ZigzagPartition


@dataclass(frozen=True)
class RankPrefill:
    """What one rank needs for one prefill (derived from a ``PrefillCommand``)."""

    token_ids: Tensor  # [R] the uncached suffix, int64
    prefix_len: int  # P, a multiple of block_size
    prefix_slots: tuple[int, ...]  # this rank's prefix blocks (depth j with j % C == rank)
    write: tuple[tuple[int, int], ...]  # (depth, slot) of new full blocks this rank stores
    block_size: int
    # Suffix rows [a, b) whose K and V CP rank 0 returns (a KV hand-off: the tokens no
    # cache block of the worker holds); None: nothing.
    export: tuple[int, int] | None = None
    # k: CP rank 0 also returns the log-probabilities of the suffix's tokens after its
    # first and the k most likely ids at each (``logprobs.py``); None: not asked.
    prompt_logprobs: int | None = None
    # Per CP rank, the depths of the new blocks it stores: a sliding-window layer's
    # halo (``halo.py``) brings each rank the rows it stores. None: not known here, and
    # such a layer gathers the whole sequence as a full layer does.
    peer_writes: tuple[tuple[int, ...], ...] | None = None


class ZigzagAttention:
    """``AttentionFn`` of one rank of a degree-C worker for one prefill."""

    def __init__(
        self,
        part: ZigzagPartition,
        comm: Communicator,
        store: PagedKVStore | None,
        step: RankPrefill,
        cpu_kernel: str = "flash",
    ) -> None:
        self.part, self.comm, self.store, self.step = part, comm, store, step
        self.cpu_kernel = cpu_kernel  # ``attention.CPU_KERNELS``
        self._halos: dict[int, _HaloIndex | None] = {}
        self.exported: list[Tensor] = []  # per layer: [2, b - a, Hkv, D] (``step.export``)
        c, bs = part.cp_degree, step.block_size
        self.num_prefix_blocks = step.prefix_len // bs
        self.max_local_blocks = math.ceil(self.num_prefix_blocks / c)
        if len(step.prefix_slots) != len(range(comm.rank, self.num_prefix_blocks, c)):
            raise ValueError("prefix slots do not match this rank's share of the prefix")
        if (step.prefix_slots or step.write) and store is None:
            raise ValueError("a prefill with a cached prefix or blocks to store needs a store")
        dev = step.token_ids.device
        self.restore = torch.tensor(part.restore_index(), dtype=torch.long, device=dev)
        # Per owned range [a, b): local query rows, and the key position of its first
        # query (keys before it are fully visible, the range itself is causal).
        self.blocks: list[tuple[int, int, int]] = []
        local = 0
        for a, b in part.ranges(comm.rank):
            self.blocks.append((local, local + (b - a), step.prefix_len + a))
            local += b - a

    def __call__(
        self,
        layer: int,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        window: int | None = None,
        sinks: Tensor | None = None,
    ) -> Tensor:
        step, bs, c = self.step, self.step.block_size, self.part.cp_degree
        kv_local = torch.stack((k, v))  # [2, 2s, Hkv, D]
        width = self.max_local_blocks * bs
        if width:
            pk, pv = self.store.read(step.prefix_slots, layer)  # type: ignore[union-attr]
            prefix = torch.zeros((2, width, *k.shape[1:]), dtype=k.dtype, device=k.device)
            prefix[0, : pk.shape[0]] = pk
            prefix[1, : pv.shape[0]] = pv
            kv_local = torch.cat((prefix, kv_local), dim=1)
        halo = None if window is None else self._halo(window, kv_local.device)
        if halo is not None:  # [2, P + Rp, Hkv, D]: the rows some query sees or we store
            keys = self._exchange(kv_local, halo)
            suf = keys[:, step.prefix_len :]
        else:
            g = self.comm.all_gather(kv_local, tag="kv")  # [C, 2, W + 2s, Hkv, D]
            heads = g.shape[3:]
            # Prefix blocks: rank r's local block i is depth i*C + r.
            pre = g[:, :, :width].reshape(c, 2, self.max_local_blocks, bs, *heads)
            pre = pre.permute(1, 2, 0, 3, 4, 5).reshape(2, -1, *heads)[:, : step.prefix_len]
            # Suffix: rank-major -> sequence order.
            suf = g[:, :, width:].permute(1, 0, 2, 3, 4).reshape(2, -1, *heads)
            if c > 1:  # C = 1: already in order
                suf = suf[:, self.restore]
            keys = torch.cat((pre, suf), dim=1) if step.prefix_len else suf
        if step.write and self.store is not None:
            self._store_new_blocks(layer, suf)
        if step.export is not None and self.comm.rank == 0:
            a, b = step.export
            self.exported.append(suf[:, a:b].clone())
        # [1, H, T, D]: SDPA's fused CPU kernels need the batch dimension.
        kh, vh = keys[0].transpose(0, 1)[None], keys[1].transpose(0, 1)[None]  # [1, Hkv, N, D]
        qh = q.transpose(0, 1)[None]  # [1, Hq, 2s, D]
        outs = [
            self._attend(qh[:, :, lo:hi], kh, vh, start, window, sinks)
            for lo, hi, start in self.blocks
        ]
        out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)
        return out[0].transpose(0, 1)  # [2s, Hq, D]

    def _halo(self, window: int, device: torch.device) -> _HaloIndex | None:
        """This rank's halo exchange for ``window``, planned once per prefill; None
        where an all-gather is as good or the peers' writes are unknown: one rank, or
        a window that sees the whole sequence."""
        if window not in self._halos:
            step, part = self.step, self.part
            whole = window >= step.prefix_len + part.padded_len
            if part.cp_degree == 1 or whole or step.peer_writes is None:
                self._halos[window] = None
            else:
                plan = plan_halo(
                    part, self.comm.rank, step.prefix_len, step.block_size, window,
                    step.peer_writes, step.export,
                )  # fmt: skip
                self._halos[window] = _HaloIndex.of(plan, device)
        return self._halos[window]

    def _exchange(self, kv_local: Tensor, halo: _HaloIndex) -> Tensor:
        """The sequence's K/V [2, P + Rp, Hkv, D] with the rows this rank holds or
        receives in one all-to-all (tag ``halo``) in place; zeros elsewhere (no query
        of this rank sees them)."""
        n = self.step.prefix_len + self.part.padded_len
        seq = kv_local.new_zeros((2, n, *kv_local.shape[2:]))
        seq[:, halo.own_pos] = kv_local[:, halo.own_rows]
        rows = kv_local.transpose(0, 1)  # [W + 2s, 2, Hkv, D]
        got = self.comm.all_to_all([rows[i] for i in halo.send], halo.recv_rows, tag="halo")
        if halo.recv_pos.numel():
            seq[:, halo.recv_pos] = torch.cat(got).transpose(0, 1)
        return seq

    def _attend(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        start: int,
        window: int | None,
        sinks: Tensor | None,
    ) -> Tensor:
        """Queries at ``start``.. over the keys they see: all before them and their
        own causally, or with a window or sinks only those inside the window."""
        end = start + q.shape[2]
        if window is None and sinks is None:
            return prefix_causal_attention(q, k[:, :, :end], v[:, :, :end], start, self.cpu_kernel)
        first = 0 if window is None else max(0, start - window + 1)
        return windowed_attention(
            q, k[:, :, first:end], v[:, :, first:end], start, first, window, sinks
        )

    def _store_new_blocks(self, layer: int, suf: Tensor) -> None:
        bs, p = self.step.block_size, self.step.prefix_len
        offsets = torch.tensor([d * bs - p for d, _ in self.step.write], device=suf.device)
        rows = (offsets[:, None] + torch.arange(bs, device=suf.device)[None, :]).flatten()
        slots = [slot for _, slot in self.step.write]
        self.store.write(slots, layer, suf[0, rows], suf[1, rows])  # type: ignore[union-attr]


@dataclass(frozen=True)
class _HaloIndex:
    """A ``HaloPlan`` as the index tensors each layer's exchange uses."""

    own_rows: Tensor  # local rows this rank holds ...
    own_pos: Tensor  # ... and their positions
    send: tuple[Tensor, ...]  # per peer: the local rows it gets
    recv_rows: list[int]  # per peer: how many rows it sends here
    recv_pos: Tensor  # the positions of every row received, in peer order

    @classmethod
    def of(cls, plan: HaloPlan, device: torch.device) -> _HaloIndex:
        def index(values: tuple[int, ...]) -> Tensor:
            return torch.tensor(values, dtype=torch.long, device=device)

        return cls(
            own_rows=index(plan.own_rows),
            own_pos=index(plan.own_positions),
            send=tuple(index(peer) for peer in plan.send_rows),
            recv_rows=[len(peer) for peer in plan.recv_positions],
            recv_pos=index(tuple(pos for peer in plan.recv_positions for pos in peer)),
        )


@torch.inference_mode()
def prefill_rank(
    model: CausalLM,
    comm: Communicator,
    store: PagedKVStore | None,
    step: RankPrefill,
    logits: str = "last",
    exported: list[Tensor] | None = None,
    prompt: list[PromptLogprobs] | None = None,
) -> Tensor | None:
    """Run one rank's part of a zigzag prefill.

    Returns, on rank 0 of the worker, fp32 logits in sequence order ([1, V] for
    ``logits="last"``, [R, V] for ``"all"``); ``None`` on the other ranks. Issues
    one all-gather per layer (tag ``kv``) and one of the final hidden states (``out``).
    With ``step.export``, rank 0 appends to ``exported`` the K and V of those suffix
    rows: [2, layers, b - a, Hkv, D]. With ``step.prompt_logprobs`` = k, rank 0 appends
    to ``prompt`` the log-probabilities of suffix tokens 1 .. R-1 and their top k,
    computed from its own logits in chunks of rows (``logprobs.prompt_logprobs``).
    """
    part = ZigzagPartition(int(step.token_ids.numel()), comm.size)
    idx = torch.tensor(part.indices(comm.rank), dtype=torch.long, device=step.token_ids.device)
    real = idx < part.num_tokens
    ids = torch.where(real, step.token_ids[idx.clamp(max=part.num_tokens - 1)], 0)
    positions = step.prefix_len + idx
    attention = ZigzagAttention(part, comm, store, step, model.cpu_attention)
    hidden = model(ids, positions, attention, counted=real)  # [2s, H]
    if attention.exported and exported is not None:
        exported.append(torch.stack(attention.exported, dim=1))
    gathered = comm.all_gather(hidden, tag="out")  # [C, 2s, H]
    if comm.rank != 0:
        return None
    seq = gathered.reshape(-1, hidden.shape[-1])
    seq = seq[attention.restore[: part.num_tokens]] if comm.size > 1 else seq[: part.num_tokens]
    if step.prompt_logprobs is not None and prompt is not None:
        k, after = step.prompt_logprobs, step.token_ids[1:]
        prompt.append(prompt_logprobs(model.logits, seq[:-1], after, k))
    rows = seq[-1:] if logits == "last" else seq
    return model.logits(rows)
