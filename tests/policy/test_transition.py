"""A reshape end to end on the policy objects: drain (queued requests re-placed,
in-flight finish), switch (new epoch, trie hand-over), activation after every rank
acknowledges; drain and switch times recorded."""

from __future__ import annotations

import pytest

from support.policy import policy_stack
from vertumnus.policy.cache.index import CacheReport
from vertumnus.policy.cache.manager import PrefixCacheManager
from vertumnus.policy.control.rules import Controller
from vertumnus.policy.geometry import LatticeConfig, LatticeError
from vertumnus.policy.lattice import Lattice, WorkerState
from vertumnus.policy.placement.queues import PlacementRequest
from vertumnus.policy.placement.scheduler import Scheduler
from vertumnus.policy.transition import Phase, Reconfigurer


def make() -> tuple[Lattice, Scheduler, PrefixCacheManager, Controller, Reconfigurer]:
    """Workers 0, 1 (degree 1, devices 0, 1) and 2 (degree 2, devices 2-3)."""
    p = policy_stack(Lattice(LatticeConfig(4, (1, 2)), [1, 1, 2]), blocks_per_rank=8)
    return p.lattice, p.scheduler, p.cache, p.controller, p.reconfigurer


def test_merge_drains_switches_and_activates() -> None:
    lattice, sched, cache, ctl, reconf = make()
    cache.apply_report(CacheReport(0, inserted=(11, 12)))
    for rid in range(1, 7):
        sched.place(PlacementRequest(rid, 100), now=0.0)
    assert (sched.queued(0), sched.queued(1), sched.queued(2)) == ([2, 6], [3], [1, 4, 5])
    sched.start(2, now=0.0)  # worker 0 is busy; worker 1 is not
    op = lattice.merge_options()[0]
    ctl.in_flight.append(op)
    transition, requeue = reconf.begin(op, now=1.0)
    # Queued requests come back in order; the running one stays on worker 0.
    assert [r.request_id for r in requeue] == [6, 3]
    assert lattice.workers[1].state is WorkerState.SWITCHING  # idle: parked at once
    assert lattice.workers[0].state is WorkerState.DRAINING
    for r in requeue:  # only worker 2 is a candidate now
        placed = sched.place(r, now=1.0)
        assert placed is not None and placed.worker_id == 2
    with pytest.raises(LatticeError, match="is draining"):
        reconf.switch(transition, now=1.0)
    sched.complete(2)
    reconf.idle(transition, 0, now=1.5)
    assert transition.phase is Phase.SWITCHING and transition.drain_s == pytest.approx(0.5)
    adopt = reconf.switch(transition, now=1.6)
    (merged,) = transition.new_workers
    assert lattice.epoch == 1 and lattice.workers[merged].state is WorkerState.SWITCHING
    # The trie handed worker 0's prefix to the merged worker, pending: block 11 (depth
    # 0) sits on device 0, where degree 2 wants it; block 12 (depth 1) does not.
    assert [p.prefix_ids for p in adopt] == [(11,)]
    assert cache.reusable_tokens([11, 12], 40) == {}
    # Not schedulable before every rank acknowledges.
    placed = sched.place(PlacementRequest(7, 100), now=1.6)
    assert placed is not None and placed.worker_id == 2
    assert not reconf.acknowledge(transition, merged, 0, now=1.7)
    with pytest.raises(LatticeError, match=r"ranks 0\.\.1"):
        reconf.acknowledge(transition, merged, 2, now=1.7)
    assert reconf.acknowledge(transition, merged, 1, now=1.9)
    assert lattice.workers[merged].state is WorkerState.ACTIVE
    assert transition.switch_s == pytest.approx(0.4) and ctl.in_flight == []
    placed = sched.place(PlacementRequest(8, 100), now=2.0)
    assert placed is not None and placed.worker_id == merged
    cache.check_invariants(
        {w: _Held(cache, w) for w in lattice.workers}  # no physical caches here
    )
    sched.check(now=2.0)


def test_split_hands_prefixes_to_the_children() -> None:
    lattice, _, cache, _, reconf = make()
    cache.apply_report(CacheReport(2, inserted=(21, 22, 23)))
    op = lattice.split_options()[0]
    transition, requeue = reconf.begin(op, now=0.0)
    assert requeue == [] and transition.phase is Phase.SWITCHING  # idle: parked at once
    adopt = reconf.switch(transition, now=0.1)
    a, b = transition.new_workers
    # Worker 2 had block j on device 2 + j % 2: one child gets the prefix; only
    # child a (device 2) has its first block in place.
    assert [(p.dest_worker, p.prefix_ids) for p in adopt] == [(a, (21,))]
    assert not reconf.acknowledge(transition, a, 0, now=0.2)
    assert reconf.acknowledge(transition, b, 0, now=0.3)
    assert transition.phase is Phase.DONE and transition.switch_s == pytest.approx(0.3)
    assert {w.cp_degree for w in lattice.active()} == {1}


class _Held:
    """A stand-in cache that holds exactly what the trie says (no reports pending)."""

    def __init__(self, cache: PrefixCacheManager, worker_id: int) -> None:
        self.blocks = {n.block_id for n in cache.trie.worker_nodes[worker_id]}

    def can_reclaim(self, block_id: int) -> bool:
        return False

    def num_free_blocks(self) -> int:
        return 0

    def held_blocks(self) -> set[int]:
        return self.blocks
