"""KV copies rank to rank, over torch.distributed: one rank's part of a
``KVTransfer``.

Owns the two-rank groups of the pairs that exchange blocks and the exchange itself;
it does not decide what moves (the coordinator's KV ledger does) and keeps no
cache index. Each pair of ranks that exchanges blocks has a group, formed on its
first use and named by both ranks' *incarnations* (how often each was restarted),
so a restarted peer meets a new group, never the half of its predecessor's. Every
involved rank gets the same command, in the same order relative to every other
multi-rank command (the coordinator sends them in one loop), so pairs form and
exchange without deadlock. Across hosts this is the network path of a copy; the
coordinator never carries KV bytes.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
from torch import Tensor

from vertumnus.engine.comm import make_group
from vertumnus.engine.kv_store import PagedKVStore
from vertumnus.engine.messages import KVTransfer


class PairGroups:
    """One rank's groups with the peers it copies KV with, by peer."""

    def __init__(self, store: Any, rank: int, device: torch.device, timeout: timedelta) -> None:
        self.store, self.rank, self.device, self.timeout = store, rank, device, timeout
        self._pairs: dict[int, tuple[str, Any]] = {}  # peer -> (name, group)

    def get(self, peer: int, incarnations: tuple[tuple[int, int], ...]) -> Any:
        """The group with ``peer`` at the incarnations a command names: cached, or
        formed now (the peer forms it in the same command) if new or restarted."""
        incarnation = dict(incarnations)
        lo, hi = sorted((self.rank, peer))
        name = f"pair/{lo}.{incarnation[lo]}-{hi}.{incarnation[hi]}"
        cached = self._pairs.get(peer)
        if cached is None or cached[0] != name:
            self._pairs.pop(peer, None)  # a restarted peer's old pair is of no use
            group = make_group(self.store, name, (lo, hi), self.rank, self.device, self.timeout)
            cached = self._pairs[peer] = (name, group)
        return cached[1]


def check_transfer(rank: int, cmd: KVTransfer, kv: PagedKVStore) -> None:
    """Reject a malformed copy before any pair forms or any block moves.

    As a prefill's ``_check_command`` (``engine/rank.py``): every involved rank
    checks the whole command (every slot, on either side), so all accept or reject
    it together; a rank that gave up alone would leave its peer blocked in a
    receive."""
    involved = cmd.ranks
    if rank not in involved:
        raise ValueError(f"rank {rank} is in no move of copy {cmd.copy_id}")
    if sorted(r for r, _ in cmd.incarnations) != list(involved):
        raise ValueError(f"incarnations must name each of ranks {list(involved)} once")
    slots = {slot for _, src, _, dst in cmd.moves for slot in (src, dst)}
    bad = sorted(s for s in slots if not 0 <= s < kv.num_blocks)
    if bad:
        raise IndexError(f"KV slots {bad} out of range [0, {kv.num_blocks})")


def run_transfer(rank: int, kv: PagedKVStore, cmd: KVTransfer, pair: Any) -> None:
    """This rank's part of copy ``cmd``: read every block it copies or sends, post
    every send and receive at once, wait for all, then store what it copies and
    receives (so a copy reads nothing it writes).

    Per peer, the blocks of the moves between the two, in the order of ``cmd.moves``
    on both sides, travel as one K and one V tensor [n, layers, block_size, Hkv, D]
    over the pair's group (``pair(peer)``; index = position in the sorted pair). Tag
    ``2 * sender index + (0: K, 1: V)``, so the two directions never mix. The lower
    rank posts its sends first and the higher its receives: NCCL runs a pair's
    operations in order on one stream, and both sending first could wait forever."""
    local_src: list[int] = []
    local_dst: list[int] = []
    sends: dict[int, list[int]] = {}  # peer -> this rank's source slots
    recvs: dict[int, list[int]] = {}  # peer -> this rank's destination slots
    for src_rank, src_slot, dst_rank, dst_slot in cmd.moves:
        if src_rank == dst_rank == rank:
            local_src.append(src_slot)
            local_dst.append(dst_slot)
        elif src_rank == rank:
            sends.setdefault(dst_rank, []).append(src_slot)
        elif dst_rank == rank:
            recvs.setdefault(src_rank, []).append(dst_slot)
    local = kv.export(local_src) if local_src else None
    shape = kv.k.shape[1:]  # [layers, block_size, Hkv, D]
    received: list[tuple[list[int], Tensor, Tensor]] = []
    sent: list[tuple[Tensor, Tensor]] = []  # alive until every send is done
    works: list[Any] = []
    for peer in sorted({*sends, *recvs}):  # pairs form in one order on every rank
        group = pair(peer)
        me = 0 if rank < peer else 1
        posts = []
        if peer in sends:
            # The store's own device tensors: kv.export would stage them on the host.
            idx = torch.as_tensor(sends[peer], dtype=torch.long, device=kv.k.device)
            sent.append((kv.k[idx], kv.v[idx]))
            posts.append([(group.send, t, 2 * me + i) for i, t in enumerate(sent[-1])])
        if peer in recvs:
            n = len(recvs[peer])
            k = torch.empty((n, *shape), dtype=kv.k.dtype, device=kv.k.device)
            v = torch.empty_like(k)
            received.append((recvs[peer], k, v))
            posts.append([(group.recv, t, 2 * (1 - me) + i) for i, t in enumerate((k, v))])
        if me == 1:
            posts.reverse()  # [recvs, sends] when both: the mirror of the peer's order
        works += [op([t], 1 - me, tag) for ops in posts for op, t, tag in ops]
    for work in works:
        work.wait()
    if local is not None:
        kv.install(local_dst, *local)
    for slots, k, v in received:
        kv.install(slots, k, v)
