"""The prefill side of the KV hand-off: leases on a prompt's KV, and its pull.

A request with ``kv_transfer_params.do_remote_decode`` keeps, after its prefill,
the KV of its prompt but the last token (the decode side computes that one in its
first step, as vLLM's disaggregated decode does) under a *lease*:

  * the whole blocks of that prefix stay pinned in the worker's cache index (the
    blocks remain in the prefix cache as usual; the pin only keeps them from
    eviction), read from the ranks when pulled (``KVRead``, block j from CP rank
    j % C, put back in sequence order);
  * the rows no cache block holds (the partial last block, or blocks the cache could
    not take) come back with the prefill itself (``PrefillCommand.export``, from CP
    rank 0, which holds every computed row after its all-gather) and wait here;
  * the lease ends when the stream was sent whole (``pulled``), when its
    ``lease_s`` passes (``expired``), when the decode side gives up (``released``),
    or when its worker was reshaped or restarted (``moved``: the pinned index is
    gone, and a pull answers 410). Every end unpins and forgets the rows, once.

``stream`` writes the wire format of ``handoff/wire.py``, reading a chunk ahead of
the one it writes (``runtime/kv_reads.py``: ranks on this host write their blocks
straight into shared memory, which a pull whose socket writes are flushed sends
without a copy; ranks under a node agent send them as bytes). The ended handles are
remembered (a bounded number) so that a late pull gets 410 with the reason, and an
unknown one 404. Nothing here chooses workers or touches the policy's decisions.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections import OrderedDict, deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import structlog
import torch
from torch import Tensor

from vertumnus.handoff.wire import END, KVHeader, chunk_header
from vertumnus.policy.cache_index import BlockLocation, PrefillLease, WorkerCacheIndex
from vertumnus.runtime.kv_reads import CHUNK_BYTES, KVReads, bytes_of
from vertumnus.runtime.pool import RankPoolError

if TYPE_CHECKING:
    from vertumnus.runtime.coordinator import Coordinator

log = structlog.get_logger("vertumnus")

REMEMBERED = 4096  # ended handles kept for a 410
READ_AHEAD = 2  # chunks read from the ranks ahead of the one written


class HandoffError(RuntimeError):
    """A pull that cannot be served: ``status`` 404 (unknown) or 410 (ended)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class Lease:
    handle: str
    request_id: int
    worker_id: int
    first_device: int
    index: WorkerCacheIndex  # the one the pin is on
    pin: PrefillLease  # the whole blocks of the prefix, pinned
    rows: Tensor | None  # K, V of the tokens after them: [2, layers, t, Hkv, D]
    num_tokens: int  # tokens handed off: the prompt but its last
    prompt_tokens: int
    expires_s: float  # on the coordinator's clock
    expires_unix: float
    pulling: bool = False

    @property
    def blocks(self) -> list[BlockLocation]:
        return self.pin.reused


def export_range(lease: PrefillLease, prompt_tokens: int, block: int) -> tuple[int, int]:
    """The suffix rows [a, b) a hand-off prefill must return: the tokens of the
    prompt but its last that the lease's blocks (reused and new, a prefix of the
    prompt) do not hold."""
    held = min(lease.num_reused_blocks + len(lease.new), (prompt_tokens - 1) // block)
    prefix = lease.num_reused_blocks * block
    return held * block - prefix, prompt_tokens - 1 - prefix


class Handoffs:
    def __init__(self, coord: Coordinator) -> None:
        self.coord = coord
        self.cfg = coord.cfg.handoff
        # A pull needs the API key, the cluster secret or this (never nothing).
        self.secret = self.cfg.secret or secrets.token_urlsafe(24)
        self.leases: dict[str, Lease] = {}
        self.ended: OrderedDict[str, str] = OrderedDict()  # handle -> why it ended
        self.counts = {"opened": 0, "pulled": 0, "expired": 0, "released": 0, "moved": 0}
        self.pulled_bytes = 0
        self.pull_s = 0.0
        self._timer: asyncio.TimerHandle | None = None
        self.reads = KVReads(coord)  # the blocks fetched from the ranks

    # -- opening and ending ------------------------------------------------------------

    def full(self) -> bool:
        return len(self.leases) >= self.cfg.max_leases

    def open(
        self,
        request_id: int,
        worker_id: int,
        first_device: int,
        ids: Sequence[int],
        prompt_tokens: int,
        rows: Tensor | None,
    ) -> Lease:
        """Pin the prompt's whole blocks that the rows do not cover, now that the
        prefill committed them (same step of the loop: nothing evicted them)."""
        coord, block = self.coord, self.coord.cfg.engine.block_size
        index = coord.indexes[worker_id]
        num_rows = 0 if rows is None else int(rows.shape[2])
        held = (prompt_tokens - 1 - num_rows) // block
        if len(index.match(ids[:held])) < held:
            raise RankPoolError(f"request {request_id}: its blocks left worker {worker_id}")
        pin = index.begin(ids[:held], held)
        assert not pin.new, "a pin allocates nothing"
        now = coord.clock()
        lease = Lease(
            handle="kv-" + secrets.token_urlsafe(18),
            request_id=request_id,
            worker_id=worker_id,
            first_device=first_device,
            index=index,
            pin=pin,
            rows=rows,
            num_tokens=prompt_tokens - 1,
            prompt_tokens=prompt_tokens,
            expires_s=now + self.cfg.lease_s,
            expires_unix=time.time() + self.cfg.lease_s,
        )
        self.leases[lease.handle] = lease
        self.counts["opened"] += 1
        self._schedule()
        return lease

    def end(self, handle: str, why: str) -> bool:
        """End a lease (``why``: pulled, expired, released, moved); False if not open."""
        lease = self.leases.pop(handle, None)
        if lease is None:
            return False
        lease.rows = None
        if self.coord.indexes.get(lease.worker_id) is lease.index:
            self.coord.cache.apply_report(lease.index.commit(lease.pin))
        self.counts[why] += 1
        self.coord.metrics.lease_ended(why)
        self.ended[handle] = why
        while len(self.ended) > REMEMBERED:
            self.ended.popitem(last=False)
        return True

    def lookup(self, handle: str) -> Lease:
        lease = self.leases.get(handle)
        if lease is None:
            why = self.ended.get(handle)
            if why is None:
                raise HandoffError(404, f"no KV hand-off {handle!r} here")
            raise HandoffError(410, f"the KV hand-off {handle!r} ended: {why}")
        if self.coord.clock() >= lease.expires_s:
            self.end(handle, "expired")
            raise HandoffError(410, f"the KV hand-off {handle!r} ended: expired")
        if self.coord.indexes.get(lease.worker_id) is not lease.index:
            self.end(handle, "moved")
            raise HandoffError(
                410, f"the KV hand-off {handle!r} ended: moved (worker {lease.worker_id} reshaped)"
            )
        return lease

    def release(self, handle: str) -> None:
        """The decode side gave up: end the lease (404 / 410 as ``lookup``)."""
        lease = self.lookup(handle)
        if lease.pulling:
            raise HandoffError(409, f"the KV hand-off {handle!r} is being pulled")
        self.end(handle, "released")

    def expire(self) -> int:
        now = self.coord.clock()
        due = [h for h, x in self.leases.items() if x.expires_s <= now and not x.pulling]
        for handle in due:
            self.end(handle, "expired")
        return len(due)

    def close(self) -> None:
        for handle in list(self.leases):
            self.end(handle, "released")
        if self._timer is not None:
            self._timer.cancel()
        self.reads.close()

    def _schedule(self) -> None:
        """One timer for the next expiry."""
        if self._timer is not None or not self.leases:
            return
        loop = asyncio.get_running_loop()
        first = min(lease.expires_s for lease in self.leases.values())
        delay = max(0.0, first - self.coord.clock())

        def due() -> None:
            self._timer = None
            self.expire()
            self._schedule()

        self._timer = loop.call_later(delay + 1e-3, due)

    # -- the pull ------------------------------------------------------------------------

    def header(self, lease: Lease, dtype: torch.dtype) -> KVHeader:
        cfg, engine = self.coord.model_cfg, self.coord.cfg.engine
        return KVHeader(
            handle=lease.handle,
            num_tokens=lease.num_tokens,
            num_layers=cfg.num_hidden_layers,
            num_kv_heads=cfg.num_key_value_heads,
            head_dim=cfg.head_dim,
            dtype=str(dtype).removeprefix("torch."),
            block_size=engine.block_size,
            model=self.coord.cfg.model,
        )

    async def stream(
        self, lease: Lease, write: Callable[[Any], Awaitable[None]], flushed: bool = False
    ) -> int:
        """Write the lease's KV as the wire format; the bytes written. The lease ends
        (pulled) when the whole stream was written; a failure leaves it open.
        ``flushed``: ``write`` returns only once the bytes left the process (the pull
        route sets its socket's buffer limit to 0), so the shared memory the ranks
        wrote is written straight from, and reused after."""
        started = time.perf_counter()
        lease.pulling = True
        sent = 0
        ahead: deque[asyncio.Future[tuple[int, Any, Any]]] = deque()
        try:
            header, groups = self._layout(lease)
            sent += await _write_header(write, header)
            for group in groups[:READ_AHEAD]:
                ahead.append(self.reads.read(lease.first_device, group, flushed))
            for n in range(len(groups)):
                tokens, payload, shm = await ahead.popleft()
                if n + READ_AHEAD < len(groups):
                    group = groups[n + READ_AHEAD]
                    ahead.append(self.reads.read(lease.first_device, group, flushed))
                size = len(payload)
                try:
                    await write(chunk_header(tokens))
                    await write(payload)
                finally:
                    if shm is not None:
                        self.reads.give_back_segment(payload, shm)
                sent += size + 8
            if lease.rows is not None and lease.rows.shape[2]:
                await write(chunk_header(int(lease.rows.shape[2])))
                payload = bytes_of(lease.rows)
                await write(payload)
                sent += len(payload) + 8
            await write(END)
            sent += len(END)
        finally:
            lease.pulling = False
            for read in ahead:  # cut short: the reads ahead give their memory back
                read.add_done_callback(self.reads.give_back)
        self.end(lease.handle, "pulled")
        seconds = time.perf_counter() - started
        self.pulled_bytes += sent
        self.pull_s += seconds
        self.coord.metrics.pulled(sent, seconds)
        return sent

    def send_dist(
        self, lease: Lease, store: tuple[str, int], prefix: str
    ) -> tuple[KVHeader, list[dict[str, Any]], memoryview | None]:
        """The ``dist`` transport: the lease's blocks go from its ranks to the decode
        server point to point (NCCL between GPUs, gloo on CPU); returns the header,
        the layout of what the ranks send, and the rows no block holds (which the
        caller sends over HTTP). The lease ends (pulled) when every rank has sent,
        or (released) if one failed."""
        header, _ = self._layout(lease)
        lease.pulling = True
        try:
            layout, done = self.reads.send(lease.first_device, lease.blocks, store, prefix)
        except BaseException:
            lease.pulling = False
            raise

        def ended(future: asyncio.Future[Any]) -> None:
            lease.pulling = False
            failed = future.cancelled() or future.exception() is not None
            if failed:
                log.error("handoff_send_failed", handle=lease.handle, error=repr(future))
            self.end(lease.handle, "released" if failed else "pulled")
            if not failed:
                self.pulled_bytes += header.total_bytes

        done.add_done_callback(ended)
        rows = lease.rows
        return header, layout, bytes_of(rows) if rows is not None and rows.shape[2] else None

    def _layout(self, lease: Lease) -> tuple[KVHeader, list[list[BlockLocation]]]:
        """The stream's header and its chunks of blocks."""
        blocks, per = lease.blocks, max(1, CHUNK_BYTES // self.reads.block_bytes())
        groups = [blocks[i : i + per] for i in range(0, len(blocks), per)]
        dtype = self.reads.kv_dtype if groups or lease.rows is None else lease.rows.dtype
        return self.header(lease, dtype), groups

    def stream_bytes(self, lease: Lease) -> int:
        """The length of the lease's stream (a pull's Content-Length)."""
        header, groups = self._layout(lease)
        rows = 0 if lease.rows is None else int(lease.rows.shape[2])
        chunks = len(groups) + (1 if rows else 0)
        return len(header.encode()) + 8 * (chunks + 1) + header.total_bytes

    def view(self) -> dict[str, Any]:
        return {
            "open": len(self.leases),
            "pinned_blocks": sum(len(lease.blocks) for lease in self.leases.values()),
            "held_rows": sum(
                0 if lease.rows is None else int(lease.rows.shape[2])
                for lease in self.leases.values()
            ),
            **self.counts,
            "pulled_bytes": self.pulled_bytes,
            "pull_s": round(self.pull_s, 6),
        }


async def _write_header(write: Callable[[Any], Awaitable[None]], header: KVHeader) -> int:
    head = header.encode()
    await write(head)
    return len(head)
