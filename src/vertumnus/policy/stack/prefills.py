"""The prefills the workers run, one at a time each, from lease to commit.

``start`` takes the head of an idle, active worker's queue (unless its prefix is on
its way in a pull): the lease pins the prefix the worker holds (at most
``max_reuse_blocks``) and allocates the slots its new blocks go to, and the prefill
is priced on the worker's curve. ``finish`` commits the new blocks (or gives them
back), teaches the scheduler's pace and the controller, and may keep the prompt's
KV for a decode server (``cache/holds.py``) until ``release_hold``. A worker that
finishes or stops holding may park for its reshape (``reshapes``).

Pure Python, clock-free. Not owned here: which request a worker runs next (the
scheduler's queue), the open requests (``admission``), the reshapes.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from vertumnus.blocks import max_reuse_blocks
from vertumnus.policy.cache.holds import Hold, Holds, held_blocks
from vertumnus.policy.cache.host_tier import HostTiers, Load
from vertumnus.policy.cache.index import PrefillLease, WorkerCacheIndex
from vertumnus.policy.cache.manager import PrefixCacheManager
from vertumnus.policy.control.rules import Controller
from vertumnus.policy.costs import ReuseCurve
from vertumnus.policy.lattice import Lattice, WorkerState
from vertumnus.policy.placement.scheduler import PlacementRequest, Scheduler
from vertumnus.policy.pool_results import Actions, Finished, Running, Started
from vertumnus.policy.stack.admission import Admission
from vertumnus.policy.stack.pulls import Pulls


class Prefills:
    """Given the stack's parts a prefill reads and changes, and ``parked(worker,
    now)``: the reshapes' act when a participant may have become idle."""

    def __init__(
        self,
        lattice: Lattice,
        scheduler: Scheduler,
        admission: Admission,
        pulls: Pulls,
        cache: PrefixCacheManager,
        indexes: Mapping[int, WorkerCacheIndex],
        holds: Holds,
        controller: Controller,
        curves: Mapping[int, ReuseCurve],
        block_tokens: int,
        ideal_reuse: bool,
        parked: Callable[[int, float], Actions],
        tiers: HostTiers,
    ) -> None:
        self.lattice, self.scheduler, self.admission = lattice, scheduler, admission
        self.pulls, self.cache, self.indexes = pulls, cache, indexes
        self.holds, self.controller, self.curves = holds, controller, curves
        self.block_tokens, self.ideal_reuse = block_tokens, ideal_reuse
        self.parked = parked
        self.tiers = tiers  # the host tier (``cache/host_tier.py``)
        self.running: dict[int, Running] = {}  # worker -> its prefill

    def start(self, worker_id: int, now: float) -> Started | None:
        """The next prefill of an idle, active worker (None: nothing to run). The lease
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
        lease = index.begin(request.block_ids, usable)
        demotions = self.tiers.demote(w.first_device, lease.evicted_at, now)
        self.cache.apply_report(index.evictions(lease))
        self.pulls.started(request_id, worker_id, lease)
        curve = self.curves[w.cp_degree]
        cached = lease.num_reused_blocks * self.block_tokens
        if self.ideal_reuse:
            # The bound: the longest prefix cached anywhere now arrives free and at
            # once (the lease writes the blocks the worker lacks, as a copy would).
            anywhere = len(self.cache.trie.match(request.block_ids, usable))
            cached = max(cached, anywhere * self.block_tokens)
        loads, load_s = self._load_back(w.first_device, w.cp_degree, request, lease, now)
        cached += lease.loaded * self.block_tokens
        exec_s = curve.time_s(request.input_tokens, cached) + load_s
        key = request.block_ids[cached // self.block_tokens - 1] if cached else 0
        self.controller.started(request_id, worker_id, cached, key)
        self.running[worker_id] = Running(
            request_id, lease, index, now, exec_s, w.cp_degree, request.input_tokens
        )
        return Started(
            request_id,
            worker_id,
            w.cp_degree,
            w.first_device,
            lease,
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
        lease: PrefillLease,
        now: float,
    ) -> tuple[list[Load], float]:
        """Load the run of blocks after the worker's own prefix from the tiers when
        that costs less than computing them, and refresh what it reused. The options:
        its own host's run, or the whole run with the blocks other hosts' tiers hold
        (``HostTiers.remote``); the cost is concave in a run's length, so each option
        loads all of its run or none."""
        tiers, ids = self.tiers, request.block_ids
        if not tiers.enabled:
            return [], 0.0
        held = lease.num_reused_blocks
        tiers.reused(first_device, ids[:held])
        sources = tiers.sources(first_device, ids, held, held + len(lease.new), now)
        if not sources:
            return [], 0.0
        own = tiers.host_of(first_device)
        local = next((i for i, h in enumerate(sources) if h != own), len(sources))
        b, n, curve = self.block_tokens, request.input_tokens, self.curves[degree]
        options = ((local, 0), (len(sources), sum(h != own for h in sources)))
        best_run, total, best_s = tiers.cheapest(curve, n, held * b, b, degree, options)
        if not best_run or total >= curve.time_s(n, held * b):
            return [], 0.0
        lease.loaded = best_run
        targets = [(loc.block_id, loc.rank, loc.slot) for loc in lease.new[:best_run]]
        return tiers.load(first_device, targets, degree, sources[:best_run]), best_s

    def finish(
        self, worker_id: int, now: float, ok: bool, compute_s: float | None, hold: bool
    ) -> Finished:
        """The worker's prefill ended. ``ok``: its new blocks are written (they become
        visible); else they are given back, and the request stays open for
        ``replace`` or ``drop``. ``compute_s``: the ranks' own time for it, where the
        driver has it (it calibrates the controller's model; else the time since
        ``start`` does). ``hold``: its KV is handed off, and the prompt's whole blocks
        stay pinned under ``Finished.hold`` until ``release_hold``; on a worker reset
        meanwhile (its KV is gone) the prefill counts as failed (``Finished.ok`` is
        False). A participant of a reshape that runs and holds nothing parks now."""
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
            report = run.index.commit(run.lease) if ok else run.index.abort(run.lease)
            self.cache.apply_report(report)
            if ok:
                self.tiers.seen(report.inserted, now)  # (the bound writes every block)
        kept = None
        if ok and hold:
            blocks = held_blocks(run.lease, run.input_tokens, self.block_tokens)
            ids = self.admission.requests[run.request_id].block_ids
            kept = self.holds.take(run.request_id, worker_id, run.index, ids, blocks)
        self.scheduler.complete(run.request_id)
        if ok:
            self.admission.drop(run.request_id)
        return Finished(run.request_id, self.parked(worker_id, now), ok, kept)

    def release_hold(self, hold: Hold, now: float) -> Actions:
        """The decode side has the KV (or gave up, or its time is up): the pin goes, and
        a draining worker that held nothing else parks (its reshape may switch)."""
        report = self.holds.release(hold, self.indexes.get(hold.worker_id))
        if report is not None:
            self.cache.apply_report(report)
        return self.parked(hold.worker_id, now)
