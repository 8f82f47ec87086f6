"""The prefills the workers run, one at a time each, from allocation to commit.

``start`` takes the head of an idle, active worker's queue (unless its prefix is on
its way in a pull): the allocation pins the prefix the worker holds (at most
``max_reuse_blocks``) and allocates the slots its new blocks go to, and the prefill
is priced on the worker's curve. ``finish`` commits the new blocks (or gives them
back), teaches the scheduler's pace and the controller, and may keep the prompt's
KV for a decode server (``cache/holds.py``) until ``release_hold``. A worker that
finishes or stops holding may park for its reshape: both return that intent
(``ParkCheck``) for the root to route to ``reshapes``. The prefills under way are
the state's ``running``.

Pure Python, clock-free. Not owned here: which request a worker runs next (the
scheduler's queue), the open requests (``admission``), the reshapes.
"""

from __future__ import annotations

from vertumnus.blocks import max_reuse_blocks
from vertumnus.policy.cache.holds import Hold, held_blocks
from vertumnus.policy.cache.host_tier import Load
from vertumnus.policy.cache.index import BlockAllocation
from vertumnus.policy.lattice import WorkerState
from vertumnus.policy.placement.queues import PlacementRequest
from vertumnus.policy.pool_results import Actions, Finished, Running, Started
from vertumnus.policy.stack.admission import Admission
from vertumnus.policy.stack.intents import ParkCheck
from vertumnus.policy.stack.pulls import Pulls
from vertumnus.policy.stack.state import StackState


class Prefills:
    """Given the stack's state, the open requests (``admission``) and the pulls."""

    def __init__(self, state: StackState, admission: Admission, pulls: Pulls) -> None:
        self.lattice, self.scheduler, self.admission = state.lattice, state.scheduler, admission
        self.pulls, self.cache, self.indexes = pulls, state.cache, state.indexes
        self.holds, self.controller, self.curves = state.holds, state.controller, state.curves
        self.block_tokens, self.ideal_reuse = state.block_tokens, state.config.ideal_reuse
        self.tiers = state.tiers  # the host tier (``cache/host_tier.py``)
        self.running: dict[int, Running] = state.running  # worker -> its prefill

    def start(self, worker_id: int, now: float) -> Started | None:
        """The next prefill of an idle, active worker (None: nothing to run). The allocation
        pins the prefix the worker holds now (at most ``max_reuse_blocks``) and
        allocates the slots the new blocks go to."""
        w = self.lattice.workers.get(worker_id)
        if w is None or w.state is not WorkerState.ACTIVE or worker_id in self.running:
            return None
        request_id = self.scheduler.head(worker_id)
        if request_id is None:
            return None
        if self.pulls.must_wait(request_id):
            return None  # its prefix is on its way: ``Actions.woken`` says when
        self.scheduler.start(request_id, now)
        request = self.admission.requests[request_id]
        index = self.indexes[worker_id]
        usable = max_reuse_blocks(request.input_tokens, self.block_tokens)
        allocation = index.begin(request.block_ids, usable)
        demotions = self.tiers.demote(w.first_device, allocation.evicted_at, now)
        self.cache.apply_report(index.evictions(allocation))
        self.pulls.started(request_id, worker_id, allocation)
        curve = self.curves[w.cp_degree]
        cached = allocation.num_reused_blocks * self.block_tokens
        if self.ideal_reuse:
            # The bound: the longest prefix cached anywhere now arrives free and at
            # once (the allocation writes the blocks the worker lacks, as a copy would).
            anywhere = len(self.cache.trie.match(request.block_ids, usable))
            cached = max(cached, anywhere * self.block_tokens)
        loads, load_s = self._load_back(w.first_device, w.cp_degree, request, allocation, now)
        cached += allocation.loaded * self.block_tokens
        exec_s = curve.time_s(request.input_tokens, cached) + load_s
        key = request.block_ids[cached // self.block_tokens - 1] if cached else 0
        self.controller.started(request_id, worker_id, cached, key)
        self.running[worker_id] = Running(
            request_id, allocation, index, now, exec_s, w.cp_degree, request.input_tokens
        )
        return Started(
            request_id,
            worker_id,
            w.cp_degree,
            w.first_device,
            allocation,
            cached,
            exec_s,
            tuple(demotions),
            tuple(loads),
            load_s,
        )

    def _load_back(
        self,
        first_device: int,
        degree: int,
        request: PlacementRequest,
        allocation: BlockAllocation,
        now: float,
    ) -> tuple[list[Load], float]:
        """Load the run of blocks after the worker's own prefix from the tiers when
        that costs less than computing them, and refresh what it reused. The options:
        its own host's run, or the whole run with the blocks other hosts' tiers hold
        (``HostTierPolicy.remote``); the cost is concave in a run's length, so each option
        loads all of its run or none."""
        tiers, ids = self.tiers, request.block_ids
        if not tiers.enabled:
            return [], 0.0
        held = allocation.num_reused_blocks
        tiers.reused(first_device, ids[:held])
        sources = tiers.sources(first_device, ids, held, held + len(allocation.new), now)
        if not sources:
            return [], 0.0
        own = tiers.host_of(first_device)
        local = next((i for i, h in enumerate(sources) if h != own), len(sources))
        b, n, curve = self.block_tokens, request.input_tokens, self.curves[degree]
        options = ((local, 0), (len(sources), sum(h != own for h in sources)))
        best_run, total, best_s = tiers.cheapest(curve, n, held * b, b, degree, options)
        if not best_run or total >= curve.time_s(n, held * b):
            return [], 0.0
        allocation.loaded = best_run
        targets = [(loc.block_id, loc.rank, loc.slot) for loc in allocation.new[:best_run]]
        return tiers.load(first_device, targets, degree, sources[:best_run]), best_s

    def finish(
        self, worker_id: int, now: float, ok: bool, compute_s: float | None, hold: bool
    ) -> tuple[Finished, ParkCheck]:
        """The worker's prefill ended. ``ok``: its new blocks are written (they become
        visible); else they are given back, and the request stays open for
        ``replace`` or ``drop``. ``compute_s``: the ranks' own time for it, where the
        driver has it (it calibrates the controller's model; else the time since
        ``start`` does). ``hold``: its KV is handed off, and the prompt's whole blocks
        stay pinned under ``Finished.hold`` until ``release_hold``; on a worker reset
        meanwhile (its KV is gone) the prefill counts as failed (``Finished.ok`` is
        False). A participant of a reshape that runs and holds nothing parks now (the
        ``ParkCheck``, whose actions the root adds to ``Finished.actions``)."""
        run = self.running.pop(worker_id)
        current = self.indexes.get(worker_id) is run.index  # (a reset worker's is gone)
        ok = ok and (current or not hold)
        if ok:
            self.scheduler.pace.ended(run.cp_degree, run.exec_s, now - run.started_s)
            self.controller.prefill_done(
                run.cp_degree, run.input_tokens, run.exec_s, now - run.started_s, compute_s
            )
            arrived = self.admission.arrived_s.get(run.request_id)
            if arrived is not None:
                self.controller.completed(run.request_id, now - arrived)
        if current:
            report = run.index.commit(run.allocation) if ok else run.index.abort(run.allocation)
            self.cache.apply_report(report)
            if ok:
                self.tiers.seen(report.inserted, now)  # (the bound writes every block)
        kept = None
        if ok and hold:
            blocks = held_blocks(run.allocation, run.input_tokens, self.block_tokens)
            ids = self.admission.requests[run.request_id].block_ids
            kept = self.holds.take(run.request_id, worker_id, run.index, ids, blocks)
        self.scheduler.complete(run.request_id)
        if ok:
            self.admission.drop(run.request_id)
        return Finished(run.request_id, Actions(), ok, kept), ParkCheck(worker_id)

    def release_hold(self, hold: Hold, now: float) -> ParkCheck:
        """The decode side has the KV (or gave up, or its time is up): the pin goes, and
        a draining worker that held nothing else parks (its reshape may switch)."""
        report = self.holds.release(hold, self.indexes.get(hold.worker_id))
        if report is not None:
            self.cache.apply_report(report)
        return ParkCheck(hold.worker_id)
