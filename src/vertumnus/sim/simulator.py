"""The discrete-event simulator: the real policy objects, simulated workers.

The scheduler, the lattice and its controller, the reshape transitions and the
prefix-cache manager are the production objects. Only the workers are simulated:
each holds a real ``WorkerCacheIndex`` (so hits and evictions are the physical truth)
and runs its queue FIFO, one prefill at a time, taking E_C(R, P) from the profile
(times log-normal noise when ``noise_cv`` > 0) for the prefix it really reuses when
the prefill starts.

Events, in a heap ordered by (time, rank, sequence number), so runs are
deterministic for a seed::

    END (0)       a prefill ends: cache report, release, next in the queue, drains
    COPY (1)      a KV copy lands: the copies become visible; the next copy starts
    SWITCH (2)    a reshape's switch ends: new epoch, adopt plans, reservations,
                  ranks acknowledge
    WINDOW (3)    the controller's window ends: decision, drains begin
    SCAN (4)      the cache manager's scan: copy plans queue, reclamations happen
    ARRIVAL (5)   a request arrives: placement, statistics, maybe a fetch
    EXPIRE (6)    slots a reshape reserved for fetches go back to their caches

Copies run one at a time, in the order planned, as the coordinator runs them; the
KV ledger (``policy/kv_ledger.py``, the coordinator's too) turns each into slot moves
when it starts, and a switch waits for the copy under way. A copy takes latency +
moved blocks * block bytes / bandwidth, the bandwidth of NVLink within a host and
of the network between hosts; it does not slow the prefills. A reshape drains for
as long as its participants' prefills take, then switches in ``switch_s``. Requests
that find no candidate (every worker draining) wait and are placed as soon as a
worker comes back.
"""

from __future__ import annotations

import heapq
import math
import random
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from vertumnus.perfmodel import Profile
from vertumnus.policy.baselines import ROUTERS
from vertumnus.policy.cache_index import PrefillLease, WorkerCacheIndex
from vertumnus.policy.cache_manager import PrefixCacheManager
from vertumnus.policy.cache_plans import CacheManagerConfig, CopyPlan
from vertumnus.policy.controller import Controller, ControllerConfig, Decision
from vertumnus.policy.costs import CostWeights, reuse_curves
from vertumnus.policy.kv_ledger import CopyJob, KVLedger, RetentionConfig
from vertumnus.policy.lattice import Lattice, LatticeConfig, WorkerState
from vertumnus.policy.scheduler import PlacementRequest, Scheduler, SchedulerConfig
from vertumnus.policy.transition import Phase, Reconfigurer, Transition
from vertumnus.sim.workload import SimRequest
from vertumnus.slo import DEFAULT_TTFT_SLO, TtftSlo
from vertumnus.stats import progress

END, COPY, SWITCH, WINDOW, SCAN, ARRIVAL, EXPIRE = range(7)

POLICIES = ("vertumnus", "fixed", "no-replication", *ROUTERS)


class SimulationError(ValueError):
    """Settings the simulator cannot run."""


@dataclass(frozen=True)
class SimSettings:
    policy: str = "vertumnus"
    seed: int = 0
    block_tokens: int = 512
    blocks_per_rank: int = 293  # Qwen3-30B-A3B bf16 on an 80 GB GPU: ~150K tokens
    kv_bytes_per_token: int = 98_304
    devices_per_host: int = 8
    intra_host_bytes_s: float = 300e9
    inter_host_bytes_s: float = 50e9
    transfer_latency_s: float = 1e-3
    scan_interval_s: float = 5.0
    switch_s: float = 0.5
    # Per prefill, the serving path's own time around the ranks' compute (dispatch,
    # answers, bookkeeping), which keeps the worker busy: 0 for GPU studies.
    dispatch_s: float = 0.0
    noise_cv: float = 0.0
    # Where t = 0 falls in the controller's first window (seconds into it): to line
    # the windows up with a real server's, whose windows run from when it started.
    window_phase_s: float = 0.0
    slo: TtftSlo = field(default_factory=lambda: DEFAULT_TTFT_SLO)
    weights: CostWeights = field(default_factory=CostWeights)
    controller: ControllerConfig = field(default_factory=ControllerConfig)
    cache: CacheManagerConfig = field(default_factory=CacheManagerConfig)
    retention: RetentionConfig = field(default_factory=RetentionConfig)

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise SimulationError(f"unknown policy {self.policy!r}; choose from {list(POLICIES)}")
        if self.blocks_per_rank < 1 or self.block_tokens < 1 or self.kv_bytes_per_token < 1:
            raise SimulationError("blocks_per_rank, block_tokens, kv_bytes_per_token must be >= 1")
        if not (
            self.scan_interval_s > 0
            and self.switch_s >= 0
            and self.noise_cv >= 0
            and self.dispatch_s >= 0
        ):
            raise SimulationError(
                "need scan_interval_s > 0, switch_s >= 0, noise_cv >= 0, dispatch_s >= 0"
            )

    @property
    def adaptive(self) -> bool:
        return self.policy == "vertumnus"

    @property
    def replication(self) -> bool:
        return self.policy in ("vertumnus", "fixed")


@dataclass
class RequestRecord:
    request_id: int
    arrival_s: float
    input_tokens: int
    phase: int
    cached_tokens: int = 0
    worker: int | None = None
    cp_degree: int | None = None
    start_s: float | None = None
    end_s: float | None = None
    placements: int = 0
    tau_s: float = math.inf

    @property
    def ttft_s(self) -> float | None:
        return None if self.end_s is None else self.end_s - self.arrival_s


@dataclass
class WindowRow:
    window: int
    start_s: float
    end_s: float
    arrivals: int
    demand_s: float
    capacity_s: float
    composition: str
    long_fraction: float
    rule: str


@dataclass
class ReshapeRecord:
    kind: str
    started_s: float
    drain_s: float | None
    switch_s: float | None


@dataclass
class SimResult:
    records: list[RequestRecord]
    windows: list[WindowRow]
    reshapes: list[ReshapeRecord]
    decisions: list[Decision]
    copies: int
    blocks_copied: int
    reclaims: int
    wall_s: float
    sim_end_s: float
    devices: int


@dataclass
class _Worker:
    worker_id: int
    cp_degree: int
    first_device: int
    index: WorkerCacheIndex
    running: int | None = None
    lease: PrefillLease | None = None


def composition_name(counts: dict[int, int]) -> str:
    """``{4: 4, 8: 3}`` -> ``4CP4/3CP8``."""
    return "/".join(f"{n}CP{c}" for c, n in sorted(counts.items()) if n) or "-"


class Simulation:
    def __init__(
        self,
        settings: SimSettings,
        profile: Profile,
        lattice_config: LatticeConfig,
        layout: Sequence[int],
        requests: Sequence[SimRequest],
        progress: Callable[[int, int, float], None] | None = None,
    ) -> None:
        missing = set(lattice_config.degrees) - set(profile.degrees)
        if missing:
            raise SimulationError(f"the profile has no degrees {sorted(missing)}")
        if settings.adaptive:
            no_kappa = [c for c in lattice_config.degrees if c not in profile.capacity]
            if no_kappa:
                raise SimulationError(
                    f"the profile has no capacity kappa for degrees {no_kappa}: "
                    "run `python -m vertumnus capacity` on it"
                )
        self.s = settings
        self.requests = list(requests)
        self.progress = progress
        coeffs = {c: profile.coeffs[c] for c in lattice_config.degrees}
        self.curves = reuse_curves(coeffs)
        self.lattice = Lattice(lattice_config, layout)
        self.cache = PrefixCacheManager(coeffs, settings.block_tokens, settings.cache)
        router = ROUTERS.get(settings.policy, Scheduler)
        self.scheduler = router(
            self.lattice, coeffs, SchedulerConfig(weights=settings.weights), self.cache
        )
        kappa = {c: float(profile.capacity.get(c, {}).get("kappa_s", 1.0)) for c in coeffs}
        self.controller = Controller(
            settings.controller,
            self.lattice,
            kappa,
            traffic=lambda op: self.cache.reconciliation_traffic(
                op.sources, op.target_degree, op.target_firsts
            ),
        )
        self.reconf = Reconfigurer(
            self.lattice, self.scheduler, self.cache, self.controller, settings.blocks_per_rank
        )
        self.workers: dict[int, _Worker] = {}
        self.indexes: dict[int, WorkerCacheIndex] = {}  # the ledger reads it
        self.ledger = KVLedger(
            self.lattice, self.indexes, self.cache, settings.blocks_per_rank, settings.retention
        )
        self._copy_queue: deque[CopyPlan] = deque()
        self._copy_job: CopyJob | None = None  # the copy under way
        self._switch_waiting: list[Transition] = []
        for w in self.lattice.workers.values():
            self._add_worker(w.worker_id, w.cp_degree, w.first_device)
        self.rng = random.Random(settings.seed)
        self.records = [
            RequestRecord(r.request_id, r.arrival_s, r.input_tokens, r.phase) for r in self.requests
        ]
        degrees = list(lattice_config.degrees)
        for rec in self.records:
            rec.tau_s = settings.slo.tau_s(rec.input_tokens, profile.predict, degrees)
        self._events: list[tuple[float, int, int, object]] = []
        self._seq = 0
        self._waiting: list[int] = []
        self._transitions: list[Transition] = []
        self._window_arrivals = 0
        self.windows: list[WindowRow] = []
        self.reshapes: list[ReshapeRecord] = []
        self._reshape_of: dict[int, ReshapeRecord] = {}
        self._idle_windows = 0
        self.copies = self.blocks_copied = self.reclaims = 0
        self._done = 0

    # -- plumbing --------------------------------------------------------------------

    def _push(self, t: float, kind: int, payload: object = None) -> None:
        self._seq += 1
        heapq.heappush(self._events, (t, kind, self._seq, payload))

    def _add_worker(self, worker_id: int, degree: int, first: int) -> None:
        index = WorkerCacheIndex(degree, self.s.blocks_per_rank, worker_id)
        self.workers[worker_id] = _Worker(worker_id, degree, first, index)
        self.indexes[worker_id] = index
        if worker_id not in self.cache.trie.workers:
            self.cache.add_worker(worker_id, degree, first)

    # -- the run ---------------------------------------------------------------------

    def run(self) -> SimResult:
        wall = time.perf_counter()
        for r in self.requests:
            self._push(r.arrival_s, ARRIVAL, r.request_id)
        first_window = (
            self.s.controller.window_s - self.s.window_phase_s % self.s.controller.window_s
        )
        self._push(first_window, WINDOW)
        if self.s.replication:
            self._push(self.s.scan_interval_s, SCAN)
        now = 0.0
        total = len(self.requests)
        step = max(1, total // 100)
        while self._events and self._done < total:
            now, kind, _, payload = heapq.heappop(self._events)
            if kind == END:
                self._end(payload, now)  # type: ignore[arg-type]
                if self.progress is not None and self._done % step == 0:
                    self.progress(self._done, total, now)
            elif kind == ARRIVAL:
                self._window_arrivals += 1
                self._place(payload, now)  # type: ignore[arg-type]
            elif kind == COPY:
                self._copy_done(payload, now)  # type: ignore[arg-type]
            elif kind == SWITCH:
                self._switch(payload, now)  # type: ignore[arg-type]
            elif kind == WINDOW:
                self._window(now)
            elif kind == SCAN:
                self._scan(now)
            elif kind == EXPIRE:
                self.ledger.expire(now)
        if self._done < total:
            raise SimulationError(f"the run stalled: {total - self._done} requests never finished")
        self._window(now, final=True)
        if self.progress is not None:
            self.progress(total, total, now)
        return SimResult(
            records=self.records,
            windows=self.windows,
            reshapes=self.reshapes,
            decisions=self.controller.history,
            copies=self.copies,
            blocks_copied=self.blocks_copied,
            reclaims=self.reclaims,
            wall_s=time.perf_counter() - wall,
            sim_end_s=now,
            devices=self.lattice.config.num_devices,
        )

    # -- requests --------------------------------------------------------------------

    def _place(self, request_id: int, now: float) -> None:
        r = self.requests[request_id]
        placed = self.scheduler.place(
            PlacementRequest(request_id, r.input_tokens, r.block_ids), now
        )
        if placed is None:
            self._waiting.append(request_id)
            return
        rec = self.records[request_id]
        rec.placements += 1
        if rec.placements == 1:
            self.controller.record(placed.exec_s, r.input_tokens)
        if placed.update is not None and placed.update.fetch is not None:
            self._start_copy(placed.update.fetch, now)
        self._try_start(self.workers[placed.worker_id], now)

    def _try_start(self, worker: _Worker, now: float) -> None:
        if worker.running is not None:
            return
        queued = self.scheduler.queued(worker.worker_id)
        if not queued:
            return
        rid = queued[0]
        self.scheduler.start(rid, now)
        r = self.requests[rid]
        usable = (r.input_tokens - 1) // self.s.block_tokens
        lease = worker.index.begin(r.block_ids, usable)
        cached = lease.num_reused_blocks * self.s.block_tokens
        exec_s = self.curves[worker.cp_degree].time_s(r.input_tokens, cached) + self.s.dispatch_s
        if self.s.noise_cv > 0:
            sigma = math.sqrt(math.log1p(self.s.noise_cv**2))
            exec_s *= self.rng.lognormvariate(-sigma * sigma / 2, sigma)
        rec = self.records[rid]
        rec.cached_tokens, rec.worker, rec.cp_degree, rec.start_s = (
            cached,
            worker.worker_id,
            worker.cp_degree,
            now,
        )
        worker.running, worker.lease = rid, lease
        self._push(now + exec_s, END, worker.worker_id)

    def _end(self, worker_id: int, now: float) -> None:
        worker = self.workers[worker_id]
        rid, lease = worker.running, worker.lease
        assert rid is not None and lease is not None
        worker.running = worker.lease = None
        self.cache.apply_report(worker.index.commit(lease))
        self.scheduler.complete(rid)
        self.records[rid].end_s = now
        self._done += 1
        for t in self._transitions:
            if worker_id in t.op.sources and self.reconf.idle(t, worker_id, now):
                self._push(now + self.s.switch_s, SWITCH, t)
        self._try_start(worker, now)
        self._retry_waiting(now)

    def _retry_waiting(self, now: float) -> None:
        if self._waiting and self.lattice.active():
            waiting, self._waiting = self._waiting, []
            for rid in waiting:
                self._place(rid, now)

    # -- the controller --------------------------------------------------------------

    def _window(self, now: float, final: bool = False) -> None:
        """A window ends (``final``: the run ended inside it; its row is recorded but
        nothing is decided)."""
        h = self.s.controller.window_s
        decision = self.controller.end_window(self.scheduler.loads(now))
        rule = decision.rule
        if final:
            for op in decision.ops:
                self.controller.reshape_done(op)
            rule = "end"
        elif self.s.adaptive:
            for op in decision.ops:
                transition, requeue = self.reconf.begin(op, now)
                self._transitions.append(transition)
                record = ReshapeRecord(op.kind, now, None, None)
                self.reshapes.append(record)
                self._reshape_of[id(transition)] = record
                for req in requeue:
                    self._place(req.request_id, now)
                if transition.phase is Phase.SWITCHING:
                    self._push(now + self.s.switch_s, SWITCH, transition)
        else:
            for op in decision.ops:  # a fixed composition: noted, not run
                self.controller.reshape_done(op)
            rule = "fixed" if decision.ops else rule
        counts = dict(self.lattice.composition())
        start = decision.window * h
        self.windows.append(
            WindowRow(
                decision.window,
                start,
                now,
                self._window_arrivals,
                decision.demand_s,
                decision.capacity_s,
                composition_name(counts),
                decision.long_fraction,
                rule,
            )
        )
        if final:
            return
        self._idle_windows = self._idle_windows + 1 if self._window_arrivals == 0 else 0
        if self._idle_windows > 10_000 and not any(
            k != WINDOW and k != SCAN for _, k, _, _ in self._events
        ):
            raise SimulationError(f"the run stalled at t = {now:.0f} s with requests waiting")
        self._window_arrivals = 0
        self._push(now + h, WINDOW)

    def _switch(self, transition: Transition, now: float) -> None:
        if self._copy_job is not None:  # the coordinator switches between copies
            self._switch_waiting.append(transition)
            return
        retained = self.ledger.collect(transition.op.sources)
        adopt = self.reconf.switch(transition, now)
        for s in transition.op.sources:
            old = self.workers.pop(s)
            del self.indexes[s]
            assert old.running is None
        for w in transition.new_workers:
            lw = self.lattice.workers[w]
            self._add_worker(w, lw.cp_degree, lw.first_device)
        _, reserved = self.ledger.after_switch(transition.new_workers, retained, adopt, now)
        if reserved:
            self._push(now + self.s.retention.retain_s, EXPIRE)
        for w in transition.new_workers:
            for rank in range(self.lattice.workers[w].cp_degree):
                self.reconf.acknowledge(transition, w, rank, now)
        self._transitions.remove(transition)
        record = self._reshape_of.pop(id(transition))
        record.drain_s, record.switch_s = transition.drain_s, transition.switch_s
        self._retry_waiting(now)

    # -- the cache manager -----------------------------------------------------------

    def _scan(self, now: float) -> None:
        active = {
            w.worker_id: self.workers[w.worker_id].index
            for w in self.lattice.workers.values()
            if w.state is WorkerState.ACTIVE
        }
        loads = {w: self.scheduler.outstanding_s(w, now) for w in active}
        result = self.cache.scan(active, loads)
        for plan in result.copies:
            self._start_copy(plan, now)
        for rplan in result.reclaims:
            report = self.workers[rplan.worker_id].index.reclaim(rplan.block_id)
            if report is not None:
                self.cache.apply_report(report)
                self.reclaims += 1
            self.cache.finish_reclaim(rplan.plan_id, report is not None)
        self._push(now + self.s.scan_interval_s, SCAN)

    def _start_copy(self, plan: CopyPlan, now: float) -> None:
        self._copy_queue.append(plan)
        self._next_copy(now)

    def _next_copy(self, now: float) -> None:
        """Start the next queued copy that can run, unless one is under way."""
        while self._copy_job is None and self._copy_queue:
            job = self.ledger.begin_copy(self._copy_queue.popleft())
            if job is None:
                continue  # cancelled, or nothing left to copy from: a miss
            block_bytes = self.s.block_tokens * self.s.kv_bytes_per_token
            seconds = self.s.transfer_latency_s
            for src, _, dst, _ in job.moves:
                if src == dst:
                    continue
                same_host = src // self.s.devices_per_host == dst // self.s.devices_per_host
                seconds += block_bytes / (
                    self.s.intra_host_bytes_s if same_host else self.s.inter_host_bytes_s
                )
            self._copy_job = job
            self._push(now + seconds, COPY, job)

    def _copy_done(self, job: CopyJob, now: float) -> None:
        self._copy_job = None
        installed = self.ledger.commit_copy(job)
        if installed:
            self.copies += 1
            self.blocks_copied += installed
        # Switches that waited for this copy go before the copies queued behind it.
        waiting, self._switch_waiting = self._switch_waiting, []
        for transition in waiting:
            self._switch(transition, now)
        self._next_copy(now)


def terminal_progress(done: int, total: int, sim_s: float) -> None:
    progress(done, total, f"requests, t = {sim_s:,.0f} s")
