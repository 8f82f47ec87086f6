"""How the stack's parts are wired (``policy/stack/``): they share one ``StackState``,
return typed intents in the order they must happen, and the root routes them; the
controller's window is typed end to end."""

from __future__ import annotations

import pytest

from support.factories import BLOCK_SIZE, make_profile
from support.policy import COEFFS, KAPPA_S
from vertumnus.blocks import block_ids
from vertumnus.policy.control.config import ControllerConfig
from vertumnus.policy.geometry import LatticeConfig
from vertumnus.policy.lattice import WorkerState
from vertumnus.policy.placement.queues import PlacementRequest
from vertumnus.policy.pool_config import PolicyConfig, PoolSpec
from vertumnus.policy.pool_policy import PoolPolicy
from vertumnus.policy.pool_results import RulesWindow, WhatIfWindow
from vertumnus.policy.stack.intents import ParkCheck, Pump, Requeue, RetryWaiting, Step, Wipe


def make_policy(**config: object) -> PoolPolicy:
    pool = PoolSpec(LatticeConfig(4, (1, 2)), (2, 2), BLOCK_SIZE, 64)
    return PoolPolicy.build(make_profile(COEFFS, KAPPA_S), pool, PolicyConfig(**config))  # type: ignore[arg-type]


def request(rid: int, n: int) -> PlacementRequest:
    return PlacementRequest(rid, n, tuple(block_ids([rid * 31 + i for i in range(n)], BLOCK_SIZE)))


def test_the_parts_share_one_state() -> None:
    policy = make_policy()
    state = policy.state
    assert policy.indexes is state.indexes and policy.ledger is state.ledger
    assert policy.prefills.running is state.running
    assert policy.outages.down is state.down
    del state.indexes[0]
    state.add_worker(0)  # a fresh index, owned by the state
    assert policy.indexes[0].worker_id == 0 and policy.indexes[0].num_free_blocks() > 0


def test_a_reset_places_its_queue_again_before_its_cache_is_wiped() -> None:
    policy = make_policy()
    policy.arrive(request(1, 200), 0.0)
    policy.arrive(request(2, 200), 0.0)
    worker = next(w for w in (0, 1) if policy.scheduler.head(w) is not None)
    head = policy.scheduler.head(worker)
    step = policy.outages.reset(worker, 1.0)
    assert isinstance(step, Step) and len(step.then) == 2
    requeue, wipe = step.then
    assert isinstance(requeue, Requeue) and isinstance(wipe, Wipe)
    assert requeue.request_ids[0] == head
    assert wipe.worker_id == worker and wipe.devices == tuple(
        policy.lattice.workers[worker].devices
    )
    assert worker in policy.indexes  # (not yet: the root wipes it after the placements)
    actions = policy.carry_out(step, 1.0)
    assert head in [p.request_id for p in actions.placed]
    assert worker not in policy.indexes
    assert policy.lattice.workers[worker].state is WorkerState.UNAVAILABLE


def test_a_prefill_asks_for_a_park_check_and_acknowledgements_for_a_retry() -> None:
    policy = make_policy()
    policy.arrive(request(1, 200), 0.0)
    worker = next(w for w in (0, 1) if policy.scheduler.head(w) is not None)
    started = policy.prefills.start(worker, 0.0)
    assert started is not None
    finished, park = policy.prefills.finish(worker, 1.0, True, None, False)
    assert park == ParkCheck(worker) and finished.actions.placed == []
    assert policy.reshapes.parked(worker, 1.0).then == (Pump(),)
    policy.worker_failed(worker, 2.0)
    assert policy.outages.restored(worker, 3.0).then == (RetryWaiting(),)


def test_the_window_plan_is_typed_and_checks_its_evaluation() -> None:
    rules = make_policy(controller=ControllerConfig(mode="rules"))
    plan = rules.prepare_window(1.0)
    assert isinstance(plan, RulesWindow) and plan.evaluate() is None
    with pytest.raises(TypeError):
        rules.finish_window(plan, object(), 1.0)
    assert rules.finish_window(plan, None, 1.0).decision.window == 0
    whatif = make_policy()
    window = whatif.prepare_window(1.0)
    assert isinstance(window, WhatIfWindow)
    with pytest.raises(TypeError):
        whatif.finish_window(window, None, 1.0)
