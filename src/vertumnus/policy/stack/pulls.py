"""Requests that wait for a pull, and the prefixes pinned for placed requests.

When the cache manager replicates, a placed request's promised prefix is pinned at
its worker from placement until it starts: the worker's other prefills and copies
would otherwise evict it (least recently used) while the request waits in the
queue, and the request would compute what placement priced as reused. Near
saturation, where queues are long, that turns into more work, longer queues and
more evictions.

A pull (``cache.copy_cost``) copies a request's prefix to the worker it was placed on
while that worker works off its queue. The request must not start before the copy
ended (``must_wait``), and what the copy brought must still be there when it
starts: between the copy's landing and the request's start, the worker's other
prefills and copies would otherwise evict the pulled blocks (least recently used)
and the request would compute them after all. So, when a pull ends, the prefix
its waiting requests would reuse is pinned in the worker's cache index until each
starts (``started``) or leaves (``forget``). Likewise the source's copy of the
prefix is pinned from the moment the pull is planned until it ended (``queued``,
``sweep``): while the pull waits for the copy lanes, the source's own prefills would
otherwise evict it, and the request would compute what it was promised.

Pure bookkeeping for the stack (``admission`` and ``prefills`` call it, the root
when a copy ended); the trie learns nothing from a pin (the blocks stay held
either way). Not owned here: whether to pull (the scheduler's cost rule),
the copy itself (the copy lanes and the KV ledger).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from vertumnus.blocks import max_reuse_blocks
from vertumnus.policy.cache.index import BlockAllocation, WorkerCacheIndex
from vertumnus.policy.cache.nodes import Node, WorkerInfo
from vertumnus.policy.cache.plans import CopyPlan
from vertumnus.policy.placement.queues import PlacementRequest
from vertumnus.policy.placement.scheduler import Scheduler
from vertumnus.policy.stack.lanes import CopyLanes
from vertumnus.policy.stack.state import StackState


class Pulls:
    def __init__(self, state: StackState, lanes: CopyLanes) -> None:
        """The state's cache manager and per-worker cache indexes; ``lanes``: the
        copy lanes, whose backlog prices a pull's wait."""
        self.cache, self.indexes = state.cache, state.indexes
        self.block_tokens = state.block_tokens
        self.lanes = lanes
        self.awaiting: dict[int, tuple[int, int]] = {}  # request -> (worker, pull plan)
        self._pins: dict[int, tuple[WorkerCacheIndex, BlockAllocation]] = {}
        self._sources: dict[int, tuple[WorkerCacheIndex, BlockAllocation]] = {}  # by plan
        # (path end, its holders, the lanes' version, now) last priced
        self._source_key: tuple[int, int, int, float] | None = None
        self._source_wait = 0.0  # then: seconds until its first holder is free

    def queued(self, plan: CopyPlan) -> None:
        """A pull was planned: pin its source's copy of the prefix until it ends."""
        src = plan.moves[0].src_worker
        index = self.indexes.get(src) if src is not None else None
        prefix = list(plan.prefix_ids)
        if index is None or len(index.match(prefix)) < len(prefix):
            return
        allocation = index.begin(prefix, len(prefix))
        assert not allocation.new, "a pin allocates nothing"
        self._sources[plan.plan_id] = (index, allocation)

    def sweep(self) -> None:
        """Unpin the sources of the pulls that ended."""
        in_flight = self.cache.copies_in_flight
        for plan_id in [p for p in self._sources if p not in in_flight]:
            self._unpin(*self._sources.pop(plan_id))

    def attach(self, scheduler: Scheduler) -> None:
        """Pulls on: the scheduler prices them, the scan prices its copies by them."""
        scheduler.pull_cost = self.cost
        self.cache.pull_copy_s = self.lanes.timer.copy_s
        self.cache.pull_source_s = self.source_s

    def source_s(self, holder: WorkerInfo, now: float) -> float:
        """Predicted seconds until ``holder``'s devices are free for a copy."""
        devices = range(holder.first_device, holder.first_device + holder.cp_degree)
        return self.lanes.ready_s(devices, now)

    def cost(
        self, path: Sequence[Node], blocks: int, worker_id: int, now: float
    ) -> tuple[float, float]:
        """A pull of ``blocks`` of MatchedPath ``path`` to ``worker_id``: seconds until it
        lands (until the devices of the destination and of the first free holder are
        free for it, then the copy), and the future prefill seconds of the blocks it
        must evict there (``cache.copy_cost``)."""
        last = path[-1]
        key = (last.block_id, last.holders, self.lanes.version, now)
        if self._source_key != key:
            # One placement prices every candidate against the same holders.
            holders = self.cache.trie.holders_of(last)
            self._source_key = key
            self._source_wait = min((self.source_s(h, now) for h in holders), default=0.0)
        info = self.cache.trie.worker(worker_id)
        dest_s = self.source_s(info, now)
        evicts = max(0, blocks - self.indexes[worker_id].num_free_blocks())
        return (
            max(dest_s, self._source_wait) + self.lanes.timer.copy_s(blocks),
            evicts * self.cache.eviction_price_s,
        )

    def placed(
        self, request: PlacementRequest, worker_id: int, plan_id: int | None, reused_tokens: int
    ) -> None:
        """The request was placed (again) on ``worker_id``, counting on
        ``reused_tokens``: what the worker holds of that is pinned until the request
        starts; it waits for pull ``plan_id`` (None: no pull) for the rest."""
        self.forget(request.request_id)
        if plan_id is not None:
            self.awaiting[request.request_id] = (worker_id, plan_id)
        if reused_tokens:
            self._pin(request, worker_id, reused_tokens // self.block_tokens)

    def must_wait(self, request_id: int) -> bool:
        """True while the pull the request waits for is under way or queued."""
        self.sweep()
        entry = self.awaiting.get(request_id)
        return entry is not None and entry[1] in self.cache.copies_in_flight

    def ended(self, plan: CopyPlan, requests: Mapping[int, PlacementRequest]) -> None:
        """A copy ended; a pull: pin, for each request waiting on it, the prefix its
        worker now holds (at most what it may reuse)."""
        if plan.kind != "pull":
            return
        self.sweep()
        for request_id, (worker_id, plan_id) in list(self.awaiting.items()):
            if plan_id != plan.plan_id:
                continue
            del self.awaiting[request_id]
            request = requests.get(request_id)
            if request is not None:
                usable = max_reuse_blocks(request.input_tokens, self.block_tokens)
                self._pin(request, worker_id, usable)

    def _pin(self, request: PlacementRequest, worker_id: int, blocks: int) -> None:
        """Pin (again) what ``worker_id`` holds of the request's first ``blocks``."""
        pinned = self._pins.pop(request.request_id, None)
        index = self.indexes.get(worker_id)
        if index is not None:
            held = len(index.match(request.block_ids[:blocks]))
            if held:
                allocation = index.begin(request.block_ids[:held], held)
                assert not allocation.new, "a pin allocates nothing"
                self._pins[request.request_id] = (index, allocation)
        if pinned is not None:
            self._unpin(*pinned)

    def started(self, request_id: int, worker_id: int, allocation: BlockAllocation) -> None:
        """The request began on ``worker_id``: its own ``allocation`` now pins what it
        reuses (unpin), and those reuses are hits for the copies that brought them
        (``cache.audit``)."""
        self.forget(request_id)
        self.cache.audit.reused(worker_id, (loc.block_id for loc in allocation.reused))

    def forget(self, request_id: int) -> None:
        """The request left its worker (started, placed again, answered): unpin."""
        self.awaiting.pop(request_id, None)
        pinned = self._pins.pop(request_id, None)
        if pinned is not None:
            self._unpin(*pinned)

    def _unpin(self, index: WorkerCacheIndex, allocation: BlockAllocation) -> None:
        if self.indexes.get(index.worker_id) is index:  # (a reset worker's is gone)
            self.cache.apply_report(index.commit(allocation))

    @property
    def pinned(self) -> int:
        """Pins held: for requests waiting to start, and on pulls' sources."""
        return len(self._pins) + len(self._sources)
