"""The copy lanes: KV copies and reshape switches, in an order the ranks can keep.

A copy moves blocks between the devices of its source and its destination; a
switch changes the geometry of whole workers. The policy grants them the ranks as
follows:

  * copies whose devices are disjoint run at once, each device on its own lanes
    (``lanes = "device"``, the default: every GPU has its own links, and the ranks
    of the server carry out concurrent copies on disjoint ranks independently);
    ``lanes = "serial"`` runs one copy at a time, on the whole pool;
  * on each device, copies start in the order they were queued: a copy that waits
    for a busy device holds that device's place against later copies (so a copy
    whose source is an earlier copy's destination waits for it);
  * a switch that is ready (every participant of the reshape parked) waits for the
    copies under way, then goes before every copy queued behind it: no copy
    starts while a switch is queued or under way (the KV ledger's view of every
    slot must be stable when a reshape collects what its workers retained);
  * a switch holds the ranks from its commit until every rank of every new
    worker has acknowledged the epoch (``release``);
  * a copy holds its devices from ``begin_copy`` (slots allocated, the source
    pinned) until its bytes are in place or the move failed (``copy_done``); a plan
    that can no longer run (cancelled, nothing left to copy) ends as a miss
    without holding anything.

``ready_s`` predicts when a copy on given devices queued now would start (the
copies under way and queued, each at the copy timer's prediction): the price of
a pull's wait. The simulator times each copy; the coordinator sends its commands
to the ranks. Pure bookkeeping, clock-free. Not owned here: what to copy (the
cache manager) or when to reshape (the controller), nor what a commit does
(``reshapes``: the lanes' ``pump`` returns the ``Commit`` intent, the root routes it).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

from vertumnus.policy.cache.copy_cost import CopyTimer
from vertumnus.policy.cache.ledger import CopyJob, KVLedger
from vertumnus.policy.cache.plans import CopyPlan
from vertumnus.policy.pool_results import Actions
from vertumnus.policy.stack.intents import Commit, Step
from vertumnus.policy.transition import Transition

LANES = ("device", "serial")
_POOL = -1  # the one lane every copy takes when lanes are serial


@dataclass
class _Copy:
    job: CopyJob
    began_s: float
    lanes: frozenset[int]


class CopyLanes:
    def __init__(
        self,
        ledger: KVLedger,
        timer: CopyTimer,
        lanes: str = "device",
    ) -> None:
        """``timer``: the copy time model, which every copy measured teaches."""
        if lanes not in LANES:
            raise ValueError(f"lanes must be one of {', '.join(LANES)}, got {lanes!r}")
        self.ledger = ledger
        self.timer = timer
        self.serial = lanes == "serial"
        self._copies: deque[CopyPlan] = deque()
        self._switches: deque[Transition] = deque()
        self.switching: Transition | None = None  # the switch under way
        self.running: dict[int, _Copy] = {}  # plan id -> the copy under way
        self._busy: set[int] = set()  # lanes of the copies under way
        self._dirty = False  # something changed since the last pump
        self._version = 0  # bumped at every change of the copies queued or under way
        self._ready: tuple[int, float, dict[int, float]] | None = None  # (version, now, ...)

    def lanes_of(self, plan: CopyPlan) -> frozenset[int]:
        """The devices a plan's moves read or write (the pool, when lanes are serial)."""
        if self.serial:
            return frozenset((_POOL,))
        return frozenset(d for m in plan.moves for d in (m.src_device, m.dst_device))

    # -- what the pricing sees ----------------------------------------------------------

    def ready_s(self, devices: Iterable[int], now: float) -> float:
        """Predicted seconds from ``now`` until a copy on ``devices``, queued now,
        could start (the copies under way, then the copies queued, on those devices)."""
        free = self._free_at(now)
        if not free:  # (no copy queued or under way: the common case, and hot)
            return 0.0
        if self.serial:
            return free.get(_POOL, now) - now
        end, get = now, free.get
        for d in devices:
            at = get(d)
            if at is not None and at > end:
                end = at
        return end - now

    def backlog_s(self, now: float) -> float:
        """Predicted seconds until every copy queued or under way is done."""
        return max(self._free_at(now).values(), default=now) - now

    def _free_at(self, now: float) -> dict[int, float]:
        """Per lane, when its last copy queued or under way is predicted to end."""
        cached = self._ready
        if cached is not None and cached[0] == self._version and cached[1] == now:
            return cached[2]
        free: dict[int, float] = {}
        for run in self.running.values():
            end = max(now, run.began_s + self.timer.copy_s(run.job.num_blocks))
            for d in run.lanes:
                free[d] = end
        for plan in self._copies:
            lanes = self.lanes_of(plan)
            start = max((free.get(d, now) for d in lanes), default=now)
            end = start + self.timer.copy_s(len(plan.moves))
            for d in lanes:
                free[d] = end
        self._ready = (self._version, now, free)
        return free

    # -- queueing and ending --------------------------------------------------------------

    @property
    def version(self) -> int:
        """Changes whenever the copies queued or under way do."""
        return self._version

    @property
    def busy(self) -> bool:
        return self.switching is not None or bool(self.running)

    def queue_copy(self, plan: CopyPlan) -> None:
        self._copies.append(plan)
        self._changed()

    def queue_switch(self, transition: Transition) -> None:
        self._switches.append(transition)
        self._changed()

    def unqueue_switch(self, transition: Transition) -> None:
        """A queued switch that will not run (its reshape was rolled back)."""
        if transition in self._switches:
            self._switches.remove(transition)
            self._changed()

    def release(self, transition: Transition) -> None:
        """The switch is done with the ranks (no-op if it is not the one under way)."""
        if self.switching is transition:
            self.switching = None
            self._changed()

    def copy_done(self, job: CopyJob, ok: bool, dest_known: bool, now: float) -> Actions:
        """The copy's bytes are in place (``ok``: its blocks become visible) or the
        move failed (nothing does); its devices are free for the next ``pump``, which
        the caller runs once it has pinned what the copy brought."""
        run = self.running.pop(job.plan.plan_id, None)
        assert run is not None and run.job is job, "not a copy under way"
        self._busy -= run.lanes
        self._changed()
        if ok:
            self.timer.observe(job.num_blocks, now - run.began_s)
        installed = 0
        if ok and dest_known:
            installed = self.ledger.commit_copy(job)
        else:
            self.ledger.abort_copy(job)
        return _ended(Actions(), job.plan, installed)

    def _changed(self) -> None:
        self._dirty = True
        self._version += 1

    # -- granting the ranks ---------------------------------------------------------------

    def pump(self, now: float) -> Step:
        """Give the ranks to the next switch once the copies under way are done (the
        step's ``Commit``), else start every queued copy whose devices are free (in
        queue order per device)."""
        actions = Actions()
        if not self._dirty or self.switching is not None:
            return Step(actions)
        self._dirty = False
        if self._switches:
            if not self.running:
                self.switching = self._switches.popleft()
                self._changed()
                return Step(actions, (Commit(self.switching),))
            return Step(actions)
        held = set(self._busy)  # lanes taken, or promised to an earlier queued copy
        waiting: deque[CopyPlan] = deque()
        while self._copies:
            plan = self._copies.popleft()
            lanes = self.lanes_of(plan)
            if not lanes.isdisjoint(held):
                held |= lanes
                waiting.append(plan)
                continue
            job = self.ledger.begin_copy(plan)
            if job is None:  # cancelled, or nothing left to copy: a miss
                _ended(actions, plan, 0)
                continue
            self.running[plan.plan_id] = _Copy(job, now, lanes)
            self._busy |= lanes
            held |= lanes
            actions.copies.append(job)
        self._copies = waiting
        self._version += 1
        return Step(actions)


def _ended(actions: Actions, plan: CopyPlan, installed: int) -> Actions:
    """Note that ``plan`` ended; a pull's worker may start the request it held back."""
    actions.copies_ended.append((plan.plan_id, installed))
    if plan.kind == "pull":
        actions.woken.append(plan.dest_worker)
    return actions
