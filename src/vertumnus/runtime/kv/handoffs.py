"""The prefill side of the KV hand-off: leases on a prompt's KV, and its pull.

A request with ``kv_transfer_params.do_remote_decode`` keeps, after its prefill,
the KV of its prompt but the last token (the decode side computes that one in its
first step, as vLLM's disaggregated decode does) under a *lease*:

  * the whole blocks of that prefix stay pinned in the worker's cache index, as
    the policy's *hold* (``policy/cache/holds.py``: taken by the prefill's ``finish``,
    in the step that commits its blocks; the blocks remain in the prefix cache as
    usual, the pin only keeps them from eviction, and a reshape of the worker waits
    for it), sent from the ranks' stores when pulled (block j from CP rank j % C,
    in sequence order);
  * the rows no cache block holds (the partial last block, or blocks the cache could
    not take) come back with the prefill itself (``PrefillCommand.export``, from CP
    rank 0, which holds every computed row after its all-gather) and wait here;
  * the lease ends when the stream was sent whole (``pulled``), when its
    ``lease_s`` passes (``expired``), when the decode side gives up (``released``),
    or when its worker failed, or was being reshaped and ``reshape_wait_s`` passed
    before the pull (``moved``: a pull answers 410). Every end releases the hold
    (the policy may then park the worker and switch its reshape) and forgets the
    rows, once.

``stream`` writes the lease's KV to a ``Sink`` (the route's socket) as
``runtime/kv/stream.py`` builds it; a switch waits for the pulls reading its ranks
(``settle``). The ended handles are remembered (a bounded number) so that a late
pull gets 410 with the reason, and an unknown one 404. Nothing here chooses workers
or touches the policy's decisions.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import structlog
from torch import Tensor

from vertumnus.kv_wire import HandoffError, KVHeader
from vertumnus.policy.cache.holds import Hold
from vertumnus.policy.lattice import WorkerState
from vertumnus.runtime.intents import Apply
from vertumnus.runtime.kv.leases import Lease, Sink, check_current
from vertumnus.runtime.kv.reads import KVReads, bytes_of
from vertumnus.runtime.kv.stream import KVStream
from vertumnus.runtime.state import Shared

log = structlog.get_logger("vertumnus")

REMEMBERED = 4096  # ended handles kept for a 410


class Handoffs:
    """Given what the parts share: the serving configuration, the model's shape, the
    policy stack (its holds and indexes), the metrics, the clock, the ranks and the
    switchboard (a hold released hands the stack's actions on as ``Apply``)."""

    def __init__(self, shared: Shared) -> None:
        serve, model = shared.cfg, shared.model
        self.serve, self.model, self.policy = serve, model, shared.policy
        self.metrics, self.clock, self.switchboard = (
            shared.metrics,
            shared.clock,
            shared.switchboard,
        )
        self.cfg = serve.handoff
        # A pull needs the API key or this (never nothing).
        self.secret = self.cfg.secret or secrets.token_urlsafe(24)
        self.leases: dict[str, Lease] = {}
        self.ended: OrderedDict[str, str] = OrderedDict()  # handle -> why it ended
        self.counts = {"opened": 0, "pulled": 0, "expired": 0, "released": 0, "moved": 0}
        self.pulled_bytes = 0
        self.pull_s = 0.0
        self._timer: asyncio.TimerHandle | None = None
        self.reads = KVReads(serve.engine, model, shared.ranks)  # the blocks read from ranks
        self.wire = KVStream(serve, model, self.reads, shared.ranks, shared.policy.indexes)
        # pulls under way: handle -> (devices read, sink, done)
        self._pulls: dict[str, tuple[set[int], Sink, asyncio.Future[None]]] = {}

    # -- opening and ending ------------------------------------------------------------

    def full(self) -> bool:
        return len(self.leases) >= self.cfg.max_leases

    def open(self, hold: Hold, first_device: int, prompt_tokens: int, rows: Tensor | None) -> Lease:
        """A lease on the KV the policy holds for the request (``finish(hold=True)``)
        and the rows its prefill exported (the tokens the hold's blocks do not cover)."""
        block = self.serve.engine.block_size
        state = None
        if self.model.dsv4 is not None:  # the prompt's state, whole (``kv_wire`` kind 3)
            if rows is None or rows.dim() != 1:
                raise RuntimeError(f"request {hold.request_id}: no DeepSeek-V4 state came back")
            state, rows = rows, None
        num_rows = 0 if rows is None else int(rows.shape[2])
        if state is None and len(hold.blocks) * block + num_rows != prompt_tokens - 1:
            raise RuntimeError(
                f"request {hold.request_id}: {len(hold.blocks)} held blocks and {num_rows} "
                f"exported rows do not make the {prompt_tokens - 1} tokens of its hand-off"
            )
        now = self.clock()
        lease = Lease(
            handle="kv-" + secrets.token_urlsafe(18),
            hold=hold,
            first_device=first_device,
            rows=rows,
            state=state,
            num_tokens=prompt_tokens - 1,
            prompt_tokens=prompt_tokens,
            expires_s=now + self.cfg.lease_s,
            expires_unix=time.time() + self.cfg.lease_s,
        )
        self.leases[lease.handle] = lease
        self.counts["opened"] += 1
        self._schedule()
        w = self.policy.lattice.workers.get(hold.worker_id)
        if w is not None and w.state is WorkerState.DRAINING:
            self._cut_later(hold.worker_id)  # (a reshape waits for this one too)
        return lease

    def end(self, handle: str, why: str) -> bool:
        """End a lease (``why``: pulled, expired, released, moved); False if not open.
        Its hold goes back to the policy, which may park a draining worker."""
        lease = self.leases.pop(handle, None)
        if lease is None:
            return False
        pull = self._pulls.get(handle)
        if pull is not None and why != "pulled":  # (its KV may be overwritten from now on)
            pull[1].abort()  # the pull's writes fail: it stops reading the store
        lease.rows, lease.ended = None, why
        self.counts[why] += 1
        self.metrics.lease_ended(why)
        self.ended[handle] = why
        while len(self.ended) > REMEMBERED:
            self.ended.popitem(last=False)
        self.switchboard.route(Apply(self.policy.release_hold(lease.hold, self.clock())))
        return True

    def cut(self, worker_id: int, why: str, only_draining: bool = False) -> int:
        """End every lease on ``worker_id`` (its rank failed; or, ``only_draining``,
        its reshape's wait for the pulls is over), pulls under way cut off; how many."""
        if only_draining:
            w = self.policy.lattice.workers.get(worker_id)
            if w is None or w.state is not WorkerState.DRAINING:
                return 0
        ended = [lease for lease in self.leases.values() if lease.worker_id == worker_id]
        for lease in ended:
            self.end(lease.handle, why)  # (a pull under way is cut off)
        if ended:
            log.warning("handoffs_cut", worker=worker_id, leases=len(ended), why=why)
        return len(ended)

    def wait_for_pulls(self, workers: Sequence[int]) -> None:
        """A reshape of ``workers`` began: the leases on them, and those their last
        prefills open while they drain, have ``reshape_wait_s`` to be pulled; then
        they end as moved (and the workers park)."""
        for w in workers:
            self._cut_later(w)

    def _cut_later(self, worker_id: int) -> None:
        loop = asyncio.get_running_loop()
        loop.call_later(self.cfg.reshape_wait_s, self.cut, worker_id, "moved", True)

    def lookup(self, handle: str) -> Lease:
        lease = self.leases.get(handle)
        if lease is None:
            why = self.ended.get(handle)
            if why is None:
                raise HandoffError(f"no KV hand-off {handle!r} here", "unknown", 404)
            raise HandoffError(f"the KV hand-off {handle!r} ended: {why}", "ended", 410)
        if self.clock() >= lease.expires_s:
            self.end(handle, "expired")
            raise HandoffError(f"the KV hand-off {handle!r} ended: expired", "ended", 410)
        if self.policy.indexes.get(lease.worker_id) is not lease.index:
            self.end(handle, "moved")
            raise HandoffError(
                f"the KV hand-off {handle!r} ended: moved (worker {lease.worker_id} failed)",
                "ended",
                410,
            )
        return lease

    def why_ended(self, lease: Lease) -> str | None:
        """None while ``lease`` is open; else why it ended (pulled, expired, released,
        moved). What a caller read before an ``await`` may have ended during it."""
        if self.leases.get(lease.handle) is lease:
            return None
        return self.ended.get(lease.handle, "ended")

    def claim(self, handle: str) -> Lease:
        """The lease of a pull about to begin, marked as pulling at once (before the
        route's first ``await``), so that no second pull, release or expiry takes it
        meanwhile; ``stream`` then writes it, or ``unclaim`` gives it back. 404 / 410
        as ``lookup``, 409 if another pull has it."""
        lease = self.lookup(handle)
        if lease.pulling:
            raise HandoffError(f"the KV hand-off {handle!r} is being pulled", "busy", 409)
        lease.pulling = True
        return lease

    def unclaim(self, lease: Lease) -> None:
        """A claimed pull that did not begin (its puller left before the first byte)."""
        if lease.handle not in self._pulls:
            lease.pulling = False

    def release(self, handle: str) -> None:
        """The decode side gave up: end the lease (404 / 410 as ``lookup``)."""
        lease = self.lookup(handle)
        if lease.pulling:
            raise HandoffError(f"the KV hand-off {handle!r} is being pulled", "busy", 409)
        self.end(handle, "released")

    def expire(self) -> int:
        now = self.clock()
        due = [x for x in self.leases.values() if x.expires_s <= now and not x.pulling]
        for lease in due:
            current = self.policy.indexes.get(lease.worker_id) is lease.index
            self.end(lease.handle, "expired" if current else "moved")
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
        delay = max(0.0, first - self.clock())

        def due() -> None:
            self._timer = None
            try:
                self.expire()
            except Exception as exc:  # a bug: logged, counted; the timer goes on
                self.metrics.bug("handoff", "handoff_expiry_failed", exc)
            finally:
                self._schedule()

        self._timer = loop.call_later(delay + 1e-3, due)

    # -- the pull ------------------------------------------------------------------------

    async def stream(self, lease: Lease, sink: Sink) -> int:
        """Write the lease's KV to ``sink`` as the wire format; the bytes written. The
        lease ends (pulled) once every byte left this process; a failure leaves it
        open. A lease that ended since the caller looked it up (``claim``, then the
        route's ``await``) is not written: ``HandoffError``, 410 with why."""
        check_current(lease, self.policy.indexes)
        started = time.perf_counter()
        lease.pulling = True
        done = asyncio.get_running_loop().create_future()
        devices = {lease.first_device + loc.rank for loc in lease.blocks}
        self._pulls[lease.handle] = (devices, sink, done)
        try:
            sent = await self.wire.write(lease, sink, devices)
        finally:
            lease.pulling = False
            del self._pulls[lease.handle]
            done.set_result(None)
        self.end(lease.handle, "pulled")
        seconds = time.perf_counter() - started
        self.pulled_bytes += sent
        self.pull_s += seconds
        self.metrics.pulled(sent, seconds)
        return sent

    async def settle(self, devices: set[int], timeout_s: float | None = None) -> None:
        """Wait for the pulls reading from ``devices`` (a switch is about to give
        their slots to new workers); those still going after ``timeout_s`` (default
        ``reshape_wait_s``: a puller that stopped reading) are cut off."""
        waits = [(sink, done) for d, sink, done in self._pulls.values() if d & devices]
        if not waits:
            return
        if timeout_s is None:
            timeout_s = self.cfg.reshape_wait_s
        _, pending = await asyncio.wait([done for _, done in waits], timeout=timeout_s)
        for sink, done in waits:
            if done in pending:
                sink.abort()
        if pending:
            await asyncio.wait(pending)

    def send_dist(
        self, lease: Lease, store: tuple[str, int], prefix: str
    ) -> tuple[KVHeader, list[dict[str, Any]], memoryview | None]:
        """The ``dist`` transport: the lease's blocks go from its ranks to the decode
        server point to point (NCCL between GPUs, gloo on CPU); returns the header,
        the layout of what the ranks send, and the rows no block holds (which the
        caller sends over HTTP). The lease ends (pulled) when every rank has sent,
        or (released) if one failed. A DeepSeek-V4 state goes over HTTP only (400)."""
        if lease.state is not None:
            self.unclaim(lease)
            raise HandoffError(
                f"the KV hand-off {lease.handle!r} carries a DeepSeek-V4 state, pulled over "
                "HTTP only (GET /v1/kv/{handle}), not by the dist transport",
                "unsupported",
                400,
            )
        header, _ = self.wire.layout(lease)
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

    def stream_bytes(self, lease: Lease) -> int:
        """The length of the lease's stream (a pull's Content-Length)."""
        return self.wire.length(lease)

    def view(self) -> dict[str, Any]:
        return {
            "open": len(self.leases),
            "pinned_blocks": sum(len(lease.hold.blocks) for lease in self.leases.values()),
            "held_rows": sum(
                0 if lease.rows is None else int(lease.rows.shape[2])
                for lease in self.leases.values()
            ),
            **self.counts,
            "pulled_bytes": self.pulled_bytes,
            "pull_s": round(self.pull_s, 6),
        }
