"""Hand-off holds in the policy stack (``policy/cache/holds.py``): a prefill that hands its
KV off pins the prompt's whole blocks in the step that commits them; a reshape's
participant that holds KV does not park until the hold is released; a reset drops
the holds with the index; and a reshape that has not committed can be rolled back."""

from __future__ import annotations

import pytest

from support.factories import BLOCK_SIZE, make_profile
from support.policy import COEFFS, KAPPA_S
from vertumnus.blocks import block_ids
from vertumnus.policy.cache.holds import Hold, held_blocks
from vertumnus.policy.cache.index import BlockAllocation, BlockLocation
from vertumnus.policy.geometry import LatticeConfig, LatticeError
from vertumnus.policy.lattice import WorkerState
from vertumnus.policy.placement.queues import PlacementRequest
from vertumnus.policy.pool_config import PolicyConfig, PoolSpec
from vertumnus.policy.pool_policy import PoolPolicy
from vertumnus.policy.transition import Phase


def make_policy(layout: tuple[int, ...] = (1, 1)) -> PoolPolicy:
    pool = PoolSpec(LatticeConfig(sum(layout), (1, 2)), layout, BLOCK_SIZE, 64)
    config = PolicyConfig(adaptive=False, replication=False)
    return PoolPolicy.build(make_profile(COEFFS, KAPPA_S), pool, config)


def request(rid: int, n: int, seed: int = 0) -> PlacementRequest:
    tokens = [(seed * 7919 + i) % 997 for i in range(n)]
    return PlacementRequest(rid, n, tuple(block_ids(tokens, BLOCK_SIZE)))


def pinned(policy: PoolPolicy) -> int:
    return sum(e.refcount for i in policy.indexes.values() for e in i._entries.values())


def test_held_blocks_are_the_prompts_whole_blocks_but_its_last_token() -> None:
    def allocation(reused: int, new: int) -> BlockAllocation:
        locs = [BlockLocation(d, d, 0, d) for d in range(reused + new)]
        return BlockAllocation(reused=locs[:reused], new=locs[reused:])

    # (tokens, blocks the prefill's allocation holds, reused) -> blocks held
    for tokens, reused, new, expected in (
        (100, 0, 6, 6),
        (97, 2, 4, 6),
        (96, 0, 6, 5),  # the last token is the decode side's: block 5 is not whole
        (17, 0, 1, 1),
        (16, 0, 1, 0),
        (2, 0, 0, 0),
        (100, 1, 2, 3),  # the cache took only 3 blocks: the rest are exported rows
    ):
        assert held_blocks(allocation(reused, new), tokens, BLOCK_SIZE) == expected


def test_a_hold_pins_the_committed_blocks_until_released() -> None:
    policy = make_policy()
    policy.arrive(request(1, 100), 0.0)
    started = policy.start(0, 0.0)
    assert started is not None and len(started.allocation.new) == 6
    finished = policy.finish(0, 1.0, hold=True)
    assert finished.ok and finished.hold is not None
    hold = finished.hold
    assert [loc.depth for loc in hold.blocks] == list(range(6))
    assert pinned(policy) == 6 and policy.holds.holding(0) and len(policy.holds) == 1
    assert policy.open_requests == 0  # the request is answered; only its KV stays
    policy.release_hold(hold, 2.0)
    assert pinned(policy) == 0 and not policy.holds.holding(0)
    policy.release_hold(hold, 3.0)  # a second release is nothing
    assert pinned(policy) == 0
    for index in policy.indexes.values():
        index.check_invariants()


def test_a_draining_worker_that_holds_kv_parks_only_when_released() -> None:
    policy = make_policy()
    policy.arrive(request(1, 100), 0.0)
    policy.start(0, 0.0)
    transition, _ = policy.begin_reshape(policy.choose_reshape("merge", [0, 1], 0.0), 0.5)
    finished = policy.finish(0, 1.0, hold=True)
    assert finished.hold is not None and finished.actions.switch is None
    assert policy.lattice.workers[0].state is WorkerState.DRAINING
    assert policy.lattice.workers[1].state is WorkerState.SWITCHING  # idle: parked at once
    assert transition.phase is Phase.DRAINING
    actions = policy.release_hold(finished.hold, 2.0)
    assert actions.switch is not None and actions.switch.transition is transition
    assert transition.drain_s == pytest.approx(1.5)
    (merged,) = transition.new_workers
    assert policy.acknowledge(transition, merged, 0, 2.1).activated == []
    done = policy.acknowledge(transition, merged, 1, 2.1)
    assert done.activated == [transition] and policy.composition_name() == "1CP2"
    # The merged worker fetches the prefix worker 0 held (its copy pins only its own
    # slots while under way): then nothing is pinned.
    for job in done.copies:
        assert job.plan.kind == "fetch" and job.plan.dest_worker == merged
        policy.copy_done(job, True, 2.2)
    assert pinned(policy) == 0


def held(policy: PoolPolicy, tokens: int = 80) -> Hold:
    """Request 1 of ``tokens``, prefilled on worker 0 from 0 s to 1 s with a hold."""
    policy.arrive(request(1, tokens), 0.0)
    assert policy.start(0, 0.0) is not None
    hold = policy.finish(0, 1.0, hold=True).hold
    assert hold is not None
    return hold


def test_a_reset_drops_the_holds_of_its_worker() -> None:
    policy = make_policy()
    hold = held(policy)
    policy.worker_failed(0, 1.5)
    policy.worker_reset(0, 1.5)
    assert not policy.holds.holding(0) and len(policy.holds) == 0
    assert policy.release_hold(hold, 2.0).switch is None  # its index is gone: nothing
    policy.worker_restored(0, 3.0)
    assert pinned(policy) == 0


def test_a_hold_asked_of_a_reset_worker_fails_the_prefill() -> None:
    """Its KV went with the reset: the prefill counts as failed and the request
    stays open, to be placed again."""
    policy = make_policy()
    policy.arrive(request(1, 80), 0.0)
    policy.start(0, 0.0)
    policy.worker_failed(0, 0.5)
    policy.worker_reset(0, 0.5)
    finished = policy.finish(0, 1.0, hold=True)
    assert not finished.ok and finished.hold is None and policy.open_requests == 1
    placed = policy.replace(1, 1.0).placed
    assert [p.worker_id for p in placed] == [1]


def test_a_reshape_that_has_not_committed_rolls_back() -> None:
    policy = make_policy()
    hold = held(policy)
    transition, _ = policy.begin_reshape(policy.choose_reshape("merge", [0, 1], 1.0), 1.0)
    policy.arrive(request(2, 40, seed=1), 1.5)  # no candidate: it waits
    assert policy.waiting == 1
    actions = policy.abort_reshape(transition, 2.0)
    assert transition.phase is Phase.ROLLED_BACK and policy.transitions == []
    assert {w.state for w in policy.lattice.workers.values()} == {WorkerState.ACTIVE}
    assert [p.request_id for p in actions.placed] == [2] and policy.waiting == 0
    assert sorted(actions.woken) == [0, 1]
    # its release later parks nothing: no reshape waits for it any more
    assert policy.release_hold(hold, 3.0).switch is None
    assert policy.composition_name() == "2CP1"


def test_a_committed_reshape_cannot_roll_back() -> None:
    policy = make_policy()
    transition, actions = policy.begin_reshape(policy.choose_reshape("merge", [0, 1], 0.0), 0.0)
    assert actions.switch is not None and transition.phase is Phase.ACTIVATING
    with pytest.raises(LatticeError, match="cannot roll back"):
        policy.abort_reshape(transition, 1.0)
