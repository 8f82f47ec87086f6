"""The serial channel: KV copies and reshape switches, one at a time.

The ranks of a pool run these one at a time (a copy's pair groups and a switch's
epoch must not interleave; the KV ledger's view of every slot must be stable when a
reshape collects what its workers retained), so the policy grants them a single
channel:

  * a switch that is ready (every participant of the reshape parked) waits for the
    copy under way, then goes before the copies queued behind it;
  * a switch holds the channel from its commit until every rank of every new
    worker has acknowledged the epoch (``release``);
  * a copy holds it from ``begin_copy`` (slots allocated, the source pinned) until
    its bytes are in place or the move failed (``copy_done``); a plan that can no
    longer run (cancelled, nothing left to copy) ends as a miss without holding it.

The simulator times the holder; the coordinator sends its commands to the ranks.
Pure bookkeeping, clock-free. Not owned here: what to copy (the cache manager) or
when to reshape (the controller), nor what a commit does (``PoolPolicy``).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from vertumnus.policy.cache_plans import CopyPlan
from vertumnus.policy.cache_pull import CopyTimer
from vertumnus.policy.kv_ledger import CopyJob, KVLedger
from vertumnus.policy.pool_results import Actions, Switch
from vertumnus.policy.transition import Transition


class Channel:
    def __init__(
        self,
        ledger: KVLedger,
        commit: Callable[[Transition, float], Switch],
        timer: CopyTimer,
    ) -> None:
        """``commit(transition, now)``: the reshape's epoch, once the channel is its.
        ``timer``: the copy time model, which every copy measured teaches."""
        self.ledger = ledger
        self._commit = commit
        self.timer = timer
        self._copies: deque[CopyPlan] = deque()
        self._switches: deque[Transition] = deque()
        self.holder: CopyJob | Transition | None = None
        self._began_s = 0.0  # when the holder got the channel
        self._queued_s = 0.0  # predicted seconds of the copies queued

    def backlog_s(self, now: float) -> float:
        """Predicted seconds before a copy queued now would start (copies only)."""
        left = 0.0
        if isinstance(self.holder, CopyJob):
            predicted = self.timer.copy_s(self.holder.num_blocks)
            left = max(0.0, self._began_s + predicted - now)
        return left + max(0.0, self._queued_s)

    @property
    def busy(self) -> bool:
        return self.holder is not None

    def queue_copy(self, plan: CopyPlan) -> None:
        self._copies.append(plan)
        self._queued_s += self.timer.copy_s(len(plan.moves))

    def queue_switch(self, transition: Transition) -> None:
        self._switches.append(transition)

    def release(self, holder: CopyJob | Transition) -> None:
        """``holder`` is done with the channel (no-op if it does not hold it)."""
        if self.holder is holder:
            self.holder = None

    def copy_done(self, job: CopyJob, ok: bool, dest_known: bool, now: float) -> Actions:
        """The copy's bytes are in place (``ok``: its blocks become visible) or the
        move failed (nothing does); the channel passes on."""
        assert self.holder is job, "not the copy under way"
        self.holder = None
        if ok:
            self.timer.observe(job.num_blocks, now - self._began_s)
        installed = 0
        if ok and dest_known:
            installed = self.ledger.commit_copy(job)
        else:
            self.ledger.abort_copy(job)
        return _ended(Actions(), job.plan, installed).add(self.pump(now))

    def pump(self, now: float) -> Actions:
        """Give a free channel to the next switch, else to the next copy that can run."""
        actions = Actions()
        while self.holder is None:
            if self._switches:
                transition = self._switches.popleft()
                self.holder = transition
                actions.switch = self._commit(transition, now)
            elif self._copies:
                plan = self._copies.popleft()
                self._queued_s -= self.timer.copy_s(len(plan.moves))
                if not self._copies:
                    self._queued_s = 0.0  # no drift from the timer's updates
                job = self.ledger.begin_copy(plan)
                if job is None:  # cancelled, or nothing left to copy: a miss
                    _ended(actions, plan, 0)
                    continue
                self.holder = job
                self._began_s = now
                actions.copy = job
            else:
                break
        return actions


def _ended(actions: Actions, plan: CopyPlan, installed: int) -> Actions:
    """Note that ``plan`` ended; a pull's worker may start the request it held back."""
    actions.copies_ended.append((plan.plan_id, installed))
    if plan.kind == "pull":
        actions.woken.append(plan.dest_worker)
    return actions
