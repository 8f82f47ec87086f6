"""The compositions the what-if controller weighs, as replayable worker sets.

From the composition the pool is heading for (reshapes under way count as done),
the candidates are: holding, and k splits or k merges at one level of the degree
lattice (a degree-2C worker into two degree-C ones, or back), for k = 1, 2, 3,
then powers of two up to the moves allowed at once, within the lattice's bounds.
The k operations of a candidate are the k best options by the rules'
controller's order (least drain, then least reconciliation traffic, then device).

Each candidate carries two worker sets for the replay:

    next    from today: workers keep their backlog; a reshape's sources leave now
            (their queued requests are placed again at t = 0) and its targets
            serve after the sources' drain (their running prefill) plus the
            switch; reshapes already under way likewise
    steady  the candidate's workers, every queue empty

and the remapping of prefix holders: a source's prefixes go to the workers made of
it (a merge keeps them on one worker, a split gives each prefix to one child), as
``policy/cache/handover.py`` hands them on.

``best_start`` chooses a pool's starting composition by replaying a representative
workload over every composition of the lattice (docs/scheduling.md, "Start right").
Pure Python.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from vertumnus.policy.control.forecast import ArrivalSample
from vertumnus.policy.control.replay import ReplayModel
from vertumnus.policy.control.replay_types import ReplayWorker
from vertumnus.policy.geometry import LatticeConfig, composition_name, reachable_compositions
from vertumnus.policy.lattice import Lattice, Reshape, WorkerState

if TYPE_CHECKING:
    from vertumnus.policy.placement.scheduler import Scheduler


@dataclass(frozen=True)
class PoolInputs:
    """What the policy stack tells the controller at a decision."""

    now: float
    loads: Mapping[int, float]  # outstanding predicted work per worker
    running_left: Mapping[int, float]  # predicted seconds left of the running prefill
    queued: Mapping[int, tuple[int, ...]]  # queued request ids per worker

    @classmethod
    def of(cls, scheduler: Scheduler, now: float) -> PoolInputs:
        loads = scheduler.loads(now)
        return cls(
            now,
            loads,
            {w: max(0.0, load - scheduler.queued_s(w)) for w, load in loads.items()},
            {w: tuple(scheduler.queued(w)) for w in loads},
        )


@dataclass(frozen=True)
class Candidate:
    kind: str  # "hold" | "split" | "merge"
    level: int  # the larger degree of the pair it reshapes (0: hold)
    ops: tuple[Reshape, ...]
    composition: Mapping[int, int]
    next_workers: tuple[ReplayWorker, ...]
    steady_workers: tuple[ReplayWorker, ...]
    remap: Mapping[int, tuple[int, ...]]
    # per reshaped worker: the share of its cache left out of place (``next`` only)
    lost: Mapping[int, float]
    requeued: tuple[ArrivalSample, ...] = field(default=())
    # per op, the replay's ids of the workers it makes (in its target_firsts order)
    made: tuple[tuple[int, ...], ...] = field(default=())

    @property
    def name(self) -> str:
        return composition_name(self.composition)


def ladder(limit: int) -> list[int]:
    """1, 2, 3, then powers of two, up to ``limit``."""
    out = [k for k in (1, 2, 3) if k <= limit]
    k = 4
    while k <= limit:
        out.append(k)
        k *= 2
    return out


def candidates(
    lattice: Lattice,
    inputs: PoolInputs,
    in_flight: Sequence[Reshape],
    max_moves: int,
    backlog_scale: Mapping[int, float],
    switch_s: float,
    score: Callable[[Reshape], tuple[float, float, int]],
    sample_of: Callable[[int], ArrivalSample | None],
    disturbed: Callable[[Reshape], float],
) -> list[Candidate]:
    """Hold first, then every k-split and k-merge candidate (see the module doc).
    ``backlog_scale``: measured over predicted service per degree (turns predicted
    backlog into seconds); ``score``: the order of the options; ``disturbed``: the
    share of a reshape's cache it leaves out of place."""
    workers = lattice.workers
    next_id = [max(workers, default=0) + 1]

    def new_id() -> int:
        next_id[0] += 1
        return next_id[0] - 1

    def drain_s(op: Reshape) -> float:
        return max(
            inputs.running_left.get(s, 0.0) * backlog_scale[workers[s].cp_degree]
            for s in op.sources
            if s in workers
        )

    # The pool as it will be once the reshapes under way finish.
    base_next: list[ReplayWorker] = []
    base_steady: list[ReplayWorker] = []
    base_remap: dict[int, tuple[int, ...]] = {}
    base_lost: dict[int, float] = {}
    pending_sources: set[int] = set()
    for op in in_flight:
        present = [s for s in op.sources if s in workers]
        if len(present) != len(op.sources):
            continue  # committed: its new workers are in the lattice
        pending_sources.update(op.sources)
        ready = drain_s(op) + switch_s
        made = tuple(new_id() for _ in op.target_firsts)
        share = disturbed(op)
        for s in op.sources:
            base_remap[s] = made
            base_lost[s] = share
        for made_id in made:
            base_next.append(ReplayWorker(made_id, op.target_degree, ready))
            base_steady.append(ReplayWorker(made_id, op.target_degree, 0.0))
    for w in workers.values():
        if w.worker_id in pending_sources or w.state is WorkerState.UNAVAILABLE:
            continue
        if w.state is WorkerState.ACTIVE:
            free = inputs.loads.get(w.worker_id, 0.0) * backlog_scale[w.cp_degree]
        else:  # a new worker waiting for its ranks' acknowledgements
            free = switch_s
        base_next.append(ReplayWorker(w.worker_id, w.cp_degree, free))
        base_steady.append(ReplayWorker(w.worker_id, w.cp_degree, 0.0))
    counts: Counter[int] = Counter(w.cp_degree for w in base_steady)
    out = [
        Candidate(
            "hold",
            0,
            (),
            dict(counts),
            tuple(base_next),
            tuple(base_steady),
            dict(base_remap),
            dict(base_lost),
        )
    ]
    busy = pending_sources | {s for op in in_flight for s in op.sources}
    bounds = lattice.config
    splits = [op for op in lattice.split_options() if op.sources[0] not in busy]
    merges = [op for op in lattice.merge_options() if not busy & set(op.sources)]
    for hi in bounds.degrees[1:]:
        for kind, options in (
            ("split", [op for op in splits if op.target_degree * 2 == hi]),
            ("merge", [op for op in merges if op.target_degree == hi]),
        ):
            options.sort(key=score)
            chosen: list[Reshape] = []
            after = counts.copy()
            for op in options:
                if len(chosen) >= max_moves:
                    break
                trial = after.copy()
                trial[workers[op.sources[0]].cp_degree] -= len(op.sources)
                trial[op.target_degree] += len(op.target_firsts)
                if bounds.within_bounds(trial):
                    chosen.append(op)
                    after = trial
            for k in ladder(len(chosen)):
                out.append(
                    _candidate(kind, hi, chosen[:k], base_next, base_steady, base_remap,
                               base_lost, inputs, drain_s, switch_s, new_id, sample_of,
                               disturbed)
                )  # fmt: skip
    return out


def _candidate(
    kind: str,
    level: int,
    ops: Sequence[Reshape],
    base_next: Sequence[ReplayWorker],
    base_steady: Sequence[ReplayWorker],
    base_remap: Mapping[int, tuple[int, ...]],
    base_lost: Mapping[int, float],
    inputs: PoolInputs,
    drain_s: Callable[[Reshape], float],
    switch_s: float,
    new_id: Callable[[], int],
    sample_of: Callable[[int], ArrivalSample | None],
    disturbed: Callable[[Reshape], float],
) -> Candidate:
    gone = {s for op in ops for s in op.sources}
    nxt = [w for w in base_next if w.worker_id not in gone]
    steady = [w for w in base_steady if w.worker_id not in gone]
    remap = dict(base_remap)
    lost = dict(base_lost)
    requeued: list[ArrivalSample] = []
    made_ids: list[tuple[int, ...]] = []
    for op in ops:
        ready = drain_s(op) + switch_s
        made = tuple(new_id() for _ in op.target_firsts)
        made_ids.append(made)
        share = disturbed(op)
        for s in op.sources:
            remap[s] = made
            lost[s] = share
            for rid in inputs.queued.get(s, ()):
                sample = sample_of(rid)
                if sample is not None:
                    requeued.append(sample)
        for w in made:
            nxt.append(ReplayWorker(w, op.target_degree, ready))
            steady.append(ReplayWorker(w, op.target_degree, 0.0))
    counts = Counter(w.cp_degree for w in steady)
    return Candidate(
        kind, level, tuple(ops), dict(counts), tuple(nxt), tuple(steady), remap, lost,
        tuple(requeued), tuple(made_ids),
    )  # fmt: skip


class DisturbedShares:
    """The share of a reshape's cache it leaves out of place (``walk``: a walk of
    its sources' cache in the trie), each kept for ``keep_s``; at most ``walks`` new
    walks a decision (in a large pool the rest take the mean of those known)."""

    def __init__(
        self, walk: Callable[[Reshape], float], keep_s: float = 60.0, walks: int = 2
    ) -> None:
        self.walk, self.keep_s, self.walks = walk, keep_s, walks
        self._known: dict[Reshape, tuple[float, float]] = {}  # op -> (when, share)

    def decision(self, now: float) -> Callable[[Reshape], float]:
        """The shares as one decision at ``now`` reads them (older ones forgotten)."""
        known = self._known
        for op in [op for op, (t, _) in known.items() if now - t >= self.keep_s]:
            del known[op]
        fresh = [0]

        def share(op: Reshape) -> float:
            if op in known:
                return known[op][1]
            if fresh[0] < self.walks or not known:
                fresh[0] += 1
                known[op] = (now, self.walk(op))
                return known[op][1]
            return sum(v for _, v in known.values()) / len(known)

        return share


@dataclass(frozen=True)
class StartChoice:
    composition: dict[int, int]
    predicted_s: dict[str, float]  # composition name -> predicted mean TTFT


def best_start(
    config: LatticeConfig, model: ReplayModel, samples: Sequence[ArrivalSample]
) -> StartChoice:
    """The composition of ``config`` with the least predicted mean TTFT on
    ``samples`` (replayed from empty queues; ties go to fewer devices per worker)."""
    if not samples:
        raise ValueError("choosing a start needs a representative workload")
    origin = samples[0].arrival_s
    forecast = model.prepare(samples, origin)
    table: dict[str, float] = {}
    best: tuple[float, int, dict[int, int]] | None = None
    for comp in reachable_compositions(config):
        workers, k = [], 0
        for c, n in sorted(comp.items()):
            for _ in range(n):
                workers.append(ReplayWorker(k, c, 0.0))
                k += 1
        mean = model.run(forecast, workers).mean_ttft_s
        table[composition_name(comp)] = mean
        workers_n = sum(comp.values())
        if best is None or (mean, -workers_n) < (best[0], -best[1]):
            best = (mean, workers_n, dict(comp))
    assert best is not None
    return StartChoice(best[2], table)
