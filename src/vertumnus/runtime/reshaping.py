"""Reshapes on the live ranks: the switch of a committed epoch, who waits for it, and
the bound on a reshape's life.

The policy decides and sequences every split and merge (the controller's windows,
an operator's request): it drains the participants (a participant parks once it
runs nothing and no hand-off holds its KV: the leases on it have
``[handoff] reshape_wait_s`` to be pulled), and when they have parked and the copy
lanes are free it commits the new epoch and hands the coordinator a ``Switch``.
Here that switch is carried out: once the hand-off pulls reading from its ranks
are done, every rank of each new worker gets ``SwitchEpoch`` (its groups exist from
start-up, so this only changes which one a command names), and each ``EpochAck``
is passed to the policy, which activates the new workers after the last. A rank
that died meanwhile is skipped (its worker restarts after the switch); one that does
not answer within ``rank_timeout_s`` is taken down the same way, and so is every
rank still owing its acknowledgement when a step of the switch fails: a committed
reshape always finishes.

Every reshape is bounded: one not done ``[server] reshape_timeout_s`` after it
began is rolled back if it has not committed (its participants serve again as they
were; ``PoolPolicy.abort_reshape``), or finished by taking down the ranks that have
not acknowledged. Either is logged and counted
(``vertumnus_reshapes_rolled_back_total``).

What the policy returns is handed to the switchboard (``Apply``); a reshape that
finished returns ``CompositionChanged`` to the switchboard that reported it
(``activated``), which keeps the composition for the next start. A rank to take
down goes to recovery, a collaborator built before this part.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import structlog

from vertumnus.engine.messages import SwitchEpoch
from vertumnus.policy.lattice import Reshape, WorkerState
from vertumnus.policy.pool_results import Switch
from vertumnus.policy.transition import Phase, Transition
from vertumnus.runtime.intents import Apply, CompositionChanged
from vertumnus.runtime.kv.handoffs import Handoffs
from vertumnus.runtime.rank_link import RankLink
from vertumnus.runtime.recovery import Recovery
from vertumnus.runtime.state import Shared

log = structlog.get_logger("vertumnus")


class ReshapeFailed(RuntimeError):
    """A reshape that was rolled back (the operator's call answers 503 with this)."""


class Reshaping:
    def __init__(
        self, shared: Shared, link: RankLink, handoffs: Handoffs, recovery: Recovery
    ) -> None:
        """``link``: the ranks' acknowledgements; ``handoffs``: the pulls a switch
        waits for, and the leases a reshape gives their wait; ``recovery``: takes
        down a rank that does not acknowledge."""
        self.cfg, self.policy, self.metrics = shared.cfg, shared.policy, shared.metrics
        self.health, self.ranks, self.clock = shared.health, shared.ranks, shared.clock
        self.switchboard = shared.switchboard
        self.link, self.handoffs, self.recovery = link, handoffs, recovery
        self._waits: dict[int, asyncio.Future[Transition]] = {}  # id(transition) -> done
        self._bounds: dict[int, asyncio.TimerHandle] = {}  # id(transition) -> its bound

    def begin(self, op: Reshape) -> asyncio.Future[Transition]:
        """Drain ``op``'s workers now; the future resolves when the new workers serve
        (LatticeError if the lattice cannot run ``op`` now; ReshapeFailed if it was
        rolled back)."""
        transition, actions = self.policy.begin_reshape(op, self.clock())
        done = asyncio.get_running_loop().create_future()
        self._waits[id(transition)] = done
        ops = [{"kind": op.kind, "sources": list(op.sources), "degree": op.target_degree}]
        self.begun(transition, {"rule": "operator", "ops": ops}, len(actions.placed))
        self.switchboard.route(Apply(actions))
        return done

    def begun(self, transition: Transition, decision: dict[str, Any], requeued: int) -> None:
        """A reshape began (the controller's or an operator's): logged, on the
        timeline, its bound set, and the leases on its workers given their wait."""
        op = transition.op
        log.info("reshape_begin", kind=op.kind, sources=list(op.sources), requeued=requeued)
        self.metrics.timeline.reshaped(self.clock(), op.kind, decision)
        self.handoffs.wait_for_pulls(op.sources)
        loop = asyncio.get_running_loop()
        self._bounds[id(transition)] = loop.call_later(
            self.cfg.reshape_timeout_s, self._overdue, transition
        )

    def choose(self, op_name: str, workers: Sequence[int] | None) -> Reshape:
        """The admin endpoint's request as a lattice operation (or the least loaded
        option when ``workers`` is empty); LatticeError when it cannot be done."""
        return self.policy.choose_reshape(op_name, workers, self.clock())

    def overdue(self) -> list[Transition]:
        """Reshapes under way past ``reshape_timeout_s`` (none, but for a moment, while
        the bound does its work)."""
        limit = self.clock() - self.cfg.reshape_timeout_s
        return [t for t in self.policy.transitions if t.started_s < limit]

    async def run_switch(self, switch: Switch) -> None:
        link = self.link
        transition, epoch = switch.transition, switch.epoch
        devices = dict(switch.workers)
        owed = [
            (worker_id, cp_rank, r)
            for worker_id, ranks in switch.workers
            for cp_rank, r in enumerate(ranks)
        ]
        try:
            # A hand-off pull may be streaming blocks straight from these ranks' stores:
            # once switched, their slots may be written for the new workers.
            await self.handoffs.settle({r for _, _, r in owed})
            ranks = self.ranks.now  # (read after the wait: the shutdown may have closed them)
            if ranks is None or self.health.stopping:
                return
            acks = []
            for worker_id, _, r in owed:
                ack = link.expect_ack(r, epoch)
                if r in self.recovery.dead_ranks:
                    ack.set_result(None)  # restarted after this switch, all groups new
                else:
                    ranks.send(r, SwitchEpoch(epoch, devices[worker_id]))
                acks.append(ack)
            for (worker_id, cp_rank, r), ack in zip(list(owed), acks, strict=True):
                try:
                    await asyncio.wait_for(asyncio.shield(ack), self.cfg.engine.rank_timeout_s)
                except TimeoutError:
                    self.recovery.rank_down(r, f"no EpochAck for epoch {epoch}")
                owed.remove((worker_id, cp_rank, r))
                self.switchboard.route(
                    Apply(self.policy.acknowledge(transition, worker_id, cp_rank, self.clock()))
                )
            log.info(
                "reshape_done",
                kind=transition.op.kind,
                sources=list(transition.op.sources),
                new_workers=transition.new_workers,
                epoch=epoch,
                drain_s=transition.drain_s,
                switch_s=transition.switch_s,
                adopted_blocks=switch.adopted_blocks,
                reserved_blocks=switch.reserved_blocks,
                composition=self.composition_name(),
            )
        except Exception as exc:  # the pool failed, or a bug: the switch finishes anyway
            if self.health.stopping:  # (ranks closing under it: no bug, nothing to finish)
                log.warning("reshape_stopped", epoch=epoch, error=repr(exc))
                return
            self.metrics.bug("reshape", "reshape_step_failed", exc, epoch=epoch)
            self._finish(transition, owed, f"the switch to epoch {epoch} failed: {exc!r}")
        finally:
            link.forget_acks(epoch)

    def _finish(self, transition: Transition, owed: list[tuple[int, int, int]], why: str) -> None:
        """Finish a committed switch whose ``owed`` acknowledgements will not come:
        their ranks are taken down (their workers restart once it is done), and the
        policy is told they acknowledged."""
        for _, _, r in owed:
            self.recovery.rank_down(r, why)
        for worker_id, cp_rank, r in list(owed):
            owed.remove((worker_id, cp_rank, r))
            if transition.phase is Phase.ACTIVATING:
                self.switchboard.route(
                    Apply(self.policy.acknowledge(transition, worker_id, cp_rank, self.clock()))
                )

    def _overdue(self, transition: Transition) -> None:
        """The bound of a reshape passed: roll it back before its commit, or finish it
        after (the ranks that did not acknowledge are taken down)."""
        try:
            self._end_overdue(transition)
        except Exception as exc:  # a bug: logged with its traceback, counted
            self.metrics.bug("reshape", "reshape_step_failed", exc, step="bound")

    def _end_overdue(self, transition: Transition) -> None:
        self._bounds.pop(id(transition), None)
        if transition not in self.policy.transitions or self.health.stopping:
            return
        op, now = transition.op, self.clock()
        waited_s = round(now - transition.started_s, 3)
        if transition.phase in (Phase.DRAINING, Phase.SWITCHING):
            busy = {
                s: {
                    "running": self.policy.running(s) is not None,
                    "holds": len(self.policy.holds.of(s)),
                }
                for s in op.sources
            }
            log.error(
                "reshape_rolled_back",
                kind=op.kind,
                sources=list(op.sources),
                phase=str(transition.phase),
                waited_s=waited_s,
                participants=busy,
            )
            self.metrics.reshape_overdue("rolled_back")
            self.switchboard.route(Apply(self.policy.abort_reshape(transition, now)))
            done = self._waits.pop(id(transition), None)
            if done is not None and not done.done():
                done.set_exception(
                    ReshapeFailed(
                        f"the {op.kind} of workers {list(op.sources)} was rolled back: not "
                        f"done after {waited_s} s ([server] reshape_timeout_s)"
                    )
                )
            return
        owed = [
            (w, cp_rank, r)
            for w, acked in transition.acks.items()
            for cp_rank, r in enumerate(self.policy.lattice.workers[w].devices)
            if cp_rank not in acked
        ]
        log.error("reshape_forced", kind=op.kind, epoch=self.policy.lattice.epoch, owed=len(owed))
        self.metrics.reshape_overdue("forced")
        for _, _, r in owed:  # their acknowledgements are skipped: run_switch goes on
            self.recovery.rank_down(r, f"no EpochAck after {waited_s} s")

    def composition_name(self) -> str:
        return self.policy.composition_name((WorkerState.ACTIVE,))

    def close(self) -> None:
        """The server stops: no bound fires any more."""
        for bound in self._bounds.values():
            bound.cancel()
        self._bounds.clear()

    def activated(self, transition: Transition) -> CompositionChanged:
        """Every rank acknowledged: the new workers serve; the composition changed
        (returned: the switchboard keeps it for the next start, ``[pool] state_file``)."""
        bound = self._bounds.pop(id(transition), None)
        if bound is not None:
            bound.cancel()
        self.metrics.reshape(transition)
        self.recovery.new_workers_up(transition.new_workers)
        done = self._waits.pop(id(transition), None)
        if done is not None and not done.done():
            done.set_result(transition)
        return CompositionChanged()
