"""Communication of one CP worker's ranks, kept apart from the attention algorithm.

Owns the two collectives the zigzag prefill needs (all-gather along a new leading
dimension; all-to-all of rows, each rank sending each other rank its own number of
rows, for the halo of a sliding-window layer) over three transports:
``torch.distributed`` process groups (NCCL on CUDA, gloo on CPU), a single rank (no
communication), and threads in one process (tests and debugging); and the making of
a ``torch.distributed`` group of given ranks (``make_group``). Every call is counted
by tag, and so are the elements each rank receives from its peers (``received``), so
tests can assert how many collectives a prefill issued per layer and how much K/V it
moved.
"""

from __future__ import annotations

import math
import threading
from collections import Counter
from datetime import timedelta
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.distributed_c10d import PrefixStore

# torch >= 2.13 names it all_gather_single; older releases all_gather_into_tensor.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class Communicator(Protocol):
    rank: int  # rank within the worker, 0 .. size-1
    size: int  # the worker's CP degree
    calls: Counter[str]
    received: Counter[str]  # elements received from the peers, by tag

    def all_gather(self, t: Tensor, tag: str) -> Tensor:
        """Every rank's ``t`` (same shape on all ranks) stacked: [size, *t.shape]."""
        ...

    def all_to_all(self, send: list[Tensor], recv_rows: list[int], tag: str) -> list[Tensor]:
        """Send ``send[q]`` (rows along dim 0) to rank q; return what each rank q sent
        here, ``recv_rows[q]`` rows of the same trailing shape. Every rank calls it."""
        ...


def _split_rows(flat: Tensor, rows: list[int]) -> list[Tensor]:
    return list(torch.split(flat, rows)) if flat.shape[0] else [flat[:0] for _ in rows]


class SoloComm:
    """A worker of one rank: all-gather is the identity (still counted)."""

    def __init__(self) -> None:
        self.rank, self.size = 0, 1
        self.calls: Counter[str] = Counter()
        self.received: Counter[str] = Counter()

    def all_gather(self, t: Tensor, tag: str) -> Tensor:
        self.calls[tag] += 1
        return t.unsqueeze(0)

    def all_to_all(self, send: list[Tensor], recv_rows: list[int], tag: str) -> list[Tensor]:
        self.calls[tag] += 1
        return [send[0]]


class DistComm:
    """A worker's group in ``torch.distributed``: the default process group (None), a
    ``ProcessGroup``, or a backend built directly (``ProcessGroupGloo`` or
    ``ProcessGroupNCCL`` over a prefixed store, as the rank processes build theirs, so
    a group can be formed anew when a member restarts)."""

    def __init__(self, group: Any, rank: int, size: int) -> None:
        self.group, self.rank, self.size = group, rank, size
        self.calls: Counter[str] = Counter()
        self.received: Counter[str] = Counter()

    def all_gather(self, t: Tensor, tag: str) -> Tensor:
        self.calls[tag] += 1
        self.received[tag] += (self.size - 1) * t.numel()
        t = t.contiguous()
        # Gathered into one buffer along dim 0, then viewed per rank.
        out = torch.empty((self.size * t.shape[0], *t.shape[1:]), dtype=t.dtype, device=t.device)
        if self.group is None or isinstance(self.group, dist.ProcessGroup):
            _all_gather_single(out, t, group=self.group)
        else:
            self.group.allgather([list(out.chunk(self.size))], [t]).wait()
        return out.view(self.size, *t.shape)

    def all_to_all(self, send: list[Tensor], recv_rows: list[int], tag: str) -> list[Tensor]:
        self.calls[tag] += 1
        self.received[tag] += sum(recv_rows) * math.prod(send[0].shape[1:])
        inp = torch.cat(send).contiguous()
        tail = send[0].shape[1:]
        out = inp.new_empty((sum(recv_rows), *tail))
        sent_rows = [t.shape[0] for t in send]
        if self.group is None or isinstance(self.group, dist.ProcessGroup):
            dist.all_to_all_single(out, inp, recv_rows, sent_rows, group=self.group)
        else:
            self.group.alltoall_base(out, inp, recv_rows, sent_rows, dist.AllToAllOptions()).wait()
        return _split_rows(out, recv_rows)


def worker_group_name(ranks: tuple[int, ...], generation: int) -> str:
    return f"group/{generation}/{'-'.join(map(str, ranks))}"


def make_group(
    store: Any,
    name: str,
    ranks: tuple[int, ...],
    rank: int,
    device: torch.device,
    timeout: timedelta,
) -> Any:
    """The backend of the group of ``ranks`` over the store prefix ``name``, unique to
    this group's life (every member calls this; it returns when all have)."""
    prefix = PrefixStore(name, store)
    index = ranks.index(rank)
    if device.type == "cuda":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(prefix, index, len(ranks), options)
    return dist.ProcessGroupGloo(prefix, index, len(ranks), timeout)


class ThreadGroup:
    """Shared state of C ranks running as threads of one process."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._barrier = threading.Barrier(size)
        self._slots: list[Tensor | None] = [None] * size
        self._parts: list[list[Tensor] | None] = [None] * size

    def comm(self, rank: int) -> ThreadComm:
        return ThreadComm(self, rank)


class ThreadComm:
    def __init__(self, group: ThreadGroup, rank: int) -> None:
        self.group, self.rank, self.size = group, rank, group.size
        self.calls: Counter[str] = Counter()
        self.received: Counter[str] = Counter()

    def all_gather(self, t: Tensor, tag: str) -> Tensor:
        self.calls[tag] += 1
        self.received[tag] += (self.size - 1) * t.numel()
        g = self.group
        g._slots[self.rank] = t.clone()
        g._barrier.wait()  # everyone has published
        out = torch.stack([s for s in g._slots if s is not None])
        g._barrier.wait()  # everyone has read before the next call
        return out

    def all_to_all(self, send: list[Tensor], recv_rows: list[int], tag: str) -> list[Tensor]:
        self.calls[tag] += 1
        self.received[tag] += sum(recv_rows) * math.prod(send[0].shape[1:])
        g = self.group
        g._parts[self.rank] = [t.clone() for t in send]
        g._barrier.wait()
        got = [g._parts[q][self.rank] for q in range(self.size)]  # type: ignore[index]
        g._barrier.wait()
        if [t.shape[0] for t in got] != recv_rows:
            raise ValueError(f"expected {recv_rows} rows, peers sent {[t.shape[0] for t in got]}")
        return got
