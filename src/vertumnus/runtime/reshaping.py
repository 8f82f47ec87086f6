"""Reshapes on the live ranks: the switch of a committed epoch, and who waits for it.

The policy decides and sequences every split and merge (the controller's windows,
an operator's request): it drains the participants, and when they have parked and
the channel is free it commits the new epoch and hands the coordinator a
``Switch``. Here that switch is carried out: once the hand-off pulls reading from
its ranks are done, every rank of each new worker gets ``SwitchEpoch`` (its groups
exist from start-up, so this only changes which one a command names), and each
``EpochAck`` is passed to the policy, which activates the new workers after the
last. A rank that died meanwhile is skipped (its worker
restarts after the switch); one that does not answer within ``rank_timeout_s`` is
taken down the same way.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import TYPE_CHECKING

import structlog

from vertumnus.engine.messages import SwitchEpoch
from vertumnus.policy.lattice import Reshape
from vertumnus.policy.pool_results import Switch
from vertumnus.policy.transition import Transition

if TYPE_CHECKING:
    from vertumnus.runtime.coordinator import Coordinator

log = structlog.get_logger("vertumnus")


class Reshaping:
    def __init__(self, coord: Coordinator) -> None:
        self.coord = coord
        self._waits: dict[int, asyncio.Future[Transition]] = {}  # id(transition) -> done

    def begin(self, op: Reshape) -> asyncio.Future[Transition]:
        """Drain ``op``'s workers now; the future resolves when the new workers serve
        (LatticeError if the lattice cannot run ``op`` now)."""
        coord = self.coord
        transition, actions = coord.policy.begin_reshape(op, coord.clock())
        done = asyncio.get_running_loop().create_future()
        self._waits[id(transition)] = done
        log.info(
            "reshape_begin", kind=op.kind, sources=list(op.sources), requeued=len(actions.placed)
        )
        ops = [{"kind": op.kind, "sources": list(op.sources), "degree": op.target_degree}]
        coord.metrics.timeline.reshaped(coord.clock(), op.kind, {"rule": "operator", "ops": ops})
        coord.apply(actions)
        return done

    def choose(self, op_name: str, workers: Sequence[int] | None) -> Reshape:
        """The admin endpoint's request as a lattice operation (or the least loaded
        option when ``workers`` is empty); LatticeError when it cannot be done."""
        return self.coord.policy.choose_reshape(op_name, workers, self.coord.clock())

    async def run_switch(self, switch: Switch) -> None:
        coord = self.coord
        pool, link = coord.pool, coord.link
        assert pool is not None
        transition, epoch = switch.transition, switch.epoch
        # A hand-off pull may be streaming blocks straight from these ranks' stores:
        # once switched, their slots may be written for the new workers.
        await coord.handoffs.settle({r for _, ranks in switch.workers for r in ranks})
        acks = []
        for worker_id, ranks in switch.workers:
            for cp_rank, r in enumerate(ranks):
                ack = link.expect_ack(r, epoch)
                if r in coord.recovery.dead_ranks:
                    ack.set_result(None)  # restarted after this switch, all groups new
                else:
                    pool.send(r, SwitchEpoch(epoch, ranks))
                acks.append((worker_id, cp_rank, r, ack))
        try:
            for worker_id, cp_rank, r, ack in acks:
                try:
                    await asyncio.wait_for(asyncio.shield(ack), coord.cfg.engine.rank_timeout_s)
                except TimeoutError:
                    coord.recovery.rank_down(r, f"no EpochAck for epoch {epoch}")
                    if not ack.done():
                        raise
                coord.apply(coord.policy.acknowledge(transition, worker_id, cp_rank, coord.clock()))
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
                composition=coord.composition_name(),
            )
        except Exception as exc:  # the pool failed mid-switch
            log.error("reshape_failed", error=str(exc))
            done = self._waits.pop(id(transition), None)
            if done is not None and not done.done():
                done.set_exception(exc)
            coord.apply(coord.policy.switch_failed(transition, coord.clock()))
        finally:
            link.forget_acks(epoch)

    def activated(self, transition: Transition) -> None:
        """Every rank acknowledged: the new workers serve."""
        coord = self.coord
        coord.metrics.reshape(transition)
        coord.recovery.new_workers_up(transition.new_workers)
        done = self._waits.pop(id(transition), None)
        if done is not None and not done.done():
            done.set_result(transition)
