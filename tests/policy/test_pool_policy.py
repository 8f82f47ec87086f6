"""The one policy stack (``PoolPolicy``): what both drivers get by construction.

Each drift the simulator and the coordinator once had is pinned here: the
reconciliation-traffic tie-break of the controller, demand counted once per
request, one rule for the reusable prefix; and the stack's own contracts: the
serial channel (a switch waits for the copy under way and goes before queued
copies), waiting and refusal, a client that gives up."""

from __future__ import annotations

import pytest

from support.factories import BLOCK_SIZE, make_profile
from support.policy import COEFFS, KAPPA_S
from vertumnus.blocks import block_ids, max_reuse_blocks
from vertumnus.policy.cache.plans import CacheManagerConfig
from vertumnus.policy.control.config import ControllerConfig
from vertumnus.policy.control.whatif import WhatIfController
from vertumnus.policy.geometry import LatticeConfig
from vertumnus.policy.lattice import WorkerState
from vertumnus.policy.placement.queues import PlacementRequest
from vertumnus.policy.placement.routers import ROUTERS
from vertumnus.policy.pool_config import PolicyConfig, PolicyError, PoolSpec, preset
from vertumnus.policy.pool_policy import PoolPolicy


def make_policy(
    layout: tuple[int, ...] = (2, 2), blocks_per_rank: int = 64, **config: object
) -> PoolPolicy:
    pool = PoolSpec(LatticeConfig(sum(layout), (1, 2)), layout, BLOCK_SIZE, blocks_per_rank)
    return PoolPolicy.build(make_profile(COEFFS, KAPPA_S), pool, PolicyConfig(**config))  # type: ignore[arg-type]


def request(rid: int, n: int, seed: int = 0) -> PlacementRequest:
    tokens = [(seed * 7919 + i) % 997 for i in range(n)]
    return PlacementRequest(rid, n, tuple(block_ids(tokens, BLOCK_SIZE)))


def serve(policy: PoolPolicy, worker: int, now: float) -> int:
    """Run the worker's next prefill to its end; its request id."""
    started = policy.start(worker, now)
    assert started is not None
    return policy.finish(worker, now + started.exec_s).request_id


def test_the_controller_breaks_ties_by_reconciliation_traffic() -> None:
    # Worker 0 (devices 0-1) holds a prefix, worker 1 (devices 2-3) holds nothing:
    # both are idle (the same drain time), so a split of worker 1 moves no KV.
    policy = make_policy(
        controller=ControllerConfig(mode="rules", window_s=1.0, max_splits_per_window=1)
    )
    policy.arrive(request(1, 200), 0.0)
    assert policy.scheduler.head(0) == 1
    serve(policy, 0, 0.0)
    split_0, split_1 = policy.lattice.split_options()
    assert policy.controller.traffic(split_0) > 0 == policy.controller.traffic(split_1)
    assert policy.controller.traffic(split_0) == policy.cache.reconciliation_traffic(
        split_0.sources, split_0.target_degree, split_0.target_firsts
    )
    policy.controller.record(100.0, 200)  # far over capacity: split one worker
    outcome = policy.end_window(1.0)
    assert outcome.decision.rule == "split:capacity"
    assert [op.sources for op in outcome.decision.ops] == [(1,)]  # not the lowest device


def test_demand_is_counted_once_per_request_however_often_it_is_placed() -> None:
    policy = make_policy()
    for rid in (1, 2, 3):
        policy.arrive(request(rid, 100, seed=rid), 0.0)
    assert (policy.scheduler.queued(0), policy.scheduler.queued(1)) == ([1, 3], [2])
    policy.start(0, 0.0)
    # A reshape drains worker 0: its queued request 3 is placed again, on worker 1.
    split = next(op for op in policy.lattice.split_options() if op.sources == (0,))
    _, actions = policy.begin_reshape(split, 0.01)
    assert [(p.request_id, p.worker_id) for p in actions.placed] == [(3, 1)]
    # On worker 1, request 3's prefill fails and it is placed again.
    assert serve(policy, 1, 0.02) == 2
    assert policy.start(1, 0.2) is not None
    policy.finish(1, 0.3, ok=False)
    assert [p.request_id for p in policy.replace(3, 0.3).placed] == [3]
    decision = policy.end_window(1.0).decision
    assert decision.inputs["requests"] == 3
    e = policy.curves[2].time_s(100, 0)  # each placed at degree 2, nothing cached
    assert decision.demand_s == pytest.approx(3 * e)


def test_requests_wait_while_a_reshape_runs_and_are_counted_when_placed() -> None:
    policy = make_policy(layout=(2,))
    op = policy.lattice.split_options()[0]
    _, actions = policy.begin_reshape(op, 0.0)  # idle: it switches at once
    assert actions.switch is not None
    assert policy.arrive(request(1, 100), 0.1).placed == []  # nobody active: it waits
    assert policy.waiting == 1
    switch = actions.switch
    done = None
    for worker, devices in switch.workers:
        for rank in range(len(devices)):
            done = policy.acknowledge(switch.transition, worker, rank, 0.5)
    assert done is not None and done.activated == [switch.transition]
    assert [p.request_id for p in done.placed] == [1] and policy.waiting == 0
    assert policy.end_window(1.0).decision.inputs["requests"] == 1


def test_a_request_no_worker_can_ever_take_is_refused() -> None:
    policy = make_policy(layout=(1, 1))
    for w in (0, 1):
        policy.worker_failed(w, 0.0)
        policy.worker_abandoned(w, 0.0)  # its restart was given up
    assert policy.arrive(request(1, 10), 0.0).refused == [1]
    assert policy.open_requests == 0


def test_a_client_that_gives_up_leaves_the_queue() -> None:
    policy = make_policy(layout=(1, 1))
    for rid in (1, 2, 3):
        policy.arrive(request(rid, 50, seed=rid), 0.0)
    queued = {w: policy.scheduler.queued(w) for w in (0, 1)}
    worker = next(w for w, q in queued.items() if len(q) == 2)
    policy.abandon(queued[worker][1], 0.1)
    assert policy.scheduler.queued(worker) == queued[worker][:1]
    assert policy.open_requests == 2


def test_the_same_reuse_rule_in_the_policy_the_trie_and_the_engine() -> None:
    """A request of exactly k whole blocks reuses k - 1 of them everywhere: the last
    token must be computed for its logits."""
    from vertumnus.policy.cache.index import WorkerCacheIndex
    from vertumnus.runtime.prefill import plan_prefill

    k = 4
    n = k * BLOCK_SIZE
    assert max_reuse_blocks(n, BLOCK_SIZE) == k - 1
    policy = make_policy(layout=(1, 1, 2))
    policy.arrive(request(1, n), 0.0)
    worker = next(w for w in (0, 1, 2) if policy.scheduler.head(w) == 1)
    serve(policy, worker, 0.0)
    assert policy.cache.usable_blocks(k, n) == k - 1
    policy.arrive(request(2, n), 1.0)  # the same tokens again
    assert policy.scheduler.head(worker) == 2
    started = policy.start(worker, 1.0)
    assert started is not None and started.cached_tokens == (k - 1) * BLOCK_SIZE
    tokens = [i % 997 for i in range(n)]
    index = WorkerCacheIndex(1, 16)
    allocation, _ = plan_prefill(index, tokens, BLOCK_SIZE, 0, (0,))
    index.commit(allocation)
    allocation, cmd = plan_prefill(index, tokens, BLOCK_SIZE, 1, (0,))
    assert cmd.prefix_len == (k - 1) * BLOCK_SIZE and allocation.num_reused_blocks == k - 1


def test_a_switch_waits_for_the_copy_under_way_then_goes_before_queued_copies() -> None:
    # Workers 0-3 of degree 1 (devices 0-3), 4 and 5 of degree 2 (devices 4-7).
    policy = make_policy(layout=(1, 1, 1, 1, 2, 2), blocks_per_rank=64)
    policy.arrive(request(1, 200), 0.0)
    assert policy.scheduler.head(4) == 1  # degree 2 is faster at 200 tokens
    serve(policy, 4, 0.0)
    last = block_ids([i % 997 for i in range(200)], BLOCK_SIZE)[-1]
    (first,) = policy.queue_copy(policy.cache.plan_copy(last, 4, 0), 1.0).copies
    assert policy.lanes.busy
    second_plan = policy.cache.plan_copy(last, 4, 1)
    # The same source devices: it waits for the first.
    assert not policy.queue_copy(second_plan, 1.0).copies
    # Worker 5 is idle: its split is ready to switch, but the channel is the copy's.
    split = next(op for op in policy.lattice.split_options() if op.sources == (5,))
    _, begun = policy.begin_reshape(split, 1.1)
    assert begun.switch is None
    after_copy = policy.copy_done(first, True, 1.2)
    assert after_copy.copies_ended == [(first.plan.plan_id, 12)]  # 200 tokens: 12 blocks
    assert after_copy.switch is not None and not after_copy.copies  # the switch first
    switch = after_copy.switch
    assert [w for w, _ in switch.workers] == switch.transition.new_workers
    actions = [
        policy.acknowledge(switch.transition, worker, rank, 1.3)
        for worker, devices in switch.workers
        for rank in range(len(devices))
    ]
    assert [a.activated for a in actions] == [[], [switch.transition]]
    (queued,) = actions[-1].copies  # then the queued copy
    assert queued.plan.plan_id == second_plan.plan_id


def test_copies_on_disjoint_devices_run_at_once_in_queue_order_per_device() -> None:
    # Workers 0-3 of degree 1 (devices 0-3), 4 and 5 of degree 2 (devices 4-5, 6-7).
    policy = make_policy(layout=(1, 1, 1, 1, 2, 2), blocks_per_rank=64)
    for rid, worker in ((1, 4), (2, 5), (3, 0)):
        assert policy.arrive(request(rid, 200, seed=rid), 0.0).placed[0].worker_id == worker
    for worker in (4, 5, 0):
        serve(policy, worker, 0.0)
    last = {rid: request(rid, 200, seed=rid).block_ids[-1] for rid in (1, 2, 3)}
    channel, plan = policy.lanes, policy.cache.plan_copy
    (a,) = policy.queue_copy(plan(last[1], 4, 1), 1.0).copies  # devices 4, 5 -> 1
    assert channel.ready_s([4], 1.0) == pytest.approx(channel.timer.copy_s(12))
    assert channel.ready_s([0, 2, 3, 6, 7], 1.0) == 0.0
    c_plan = plan(last[1], 4, 2)  # devices 4, 5 busy: waits, holding device 2's place
    assert not policy.queue_copy(c_plan, 1.0).copies
    # Devices 6, 7 and 2 are free, but device 2 is the waiting copy's first.
    d_plan = plan(last[2], 5, 2)
    assert not policy.queue_copy(d_plan, 1.0).copies
    (e,) = policy.queue_copy(plan(last[3], 0, 3), 1.0).copies  # devices 0, 3: at once
    assert {a.plan.plan_id, e.plan.plan_id} == set(channel.running)
    # Device 2 is free after the copy under way on 4-5, then the two waiting for it.
    timer = channel.timer
    assert channel.ready_s([2], 1.0) == pytest.approx(
        timer.copy_s(12) + timer.copy_s(len(c_plan.moves)) + timer.copy_s(len(d_plan.moves))
    )
    (c,) = policy.copy_done(a, True, 1.1).copies
    assert c.plan.plan_id == c_plan.plan_id  # not the later copy to device 2
    # A reshape ready to switch waits for every copy under way; none starts meanwhile.
    split = next(op for op in policy.lattice.split_options() if op.sources == (5,))
    assert policy.begin_reshape(split, 1.2)[1].switch is None
    assert not policy.copy_done(c, True, 1.3).copies
    after = policy.copy_done(e, True, 1.4)
    assert after.switch is not None and not after.copies
    for worker, devices in after.switch.workers:
        for rank in range(len(devices)):
            done = policy.acknowledge(after.switch.transition, worker, rank, 1.5)
    # The last copy's source was split away while it waited: it ends as a miss. The
    # split worker's own prefix is fetched into one of its children instead.
    assert done.copies_ended == [(d_plan.plan_id, 0)]
    (fetch,) = done.copies
    assert fetch.plan.kind == "fetch"
    assert fetch.plan.dest_worker in after.switch.transition.new_workers
    # 12 blocks: the first adopted in place, the 11 behind it fetched.
    assert policy.copy_done(fetch, True, 1.6).copies_ended == [(fetch.plan.plan_id, 11)]
    assert not channel.busy and channel.backlog_s(1.6) == 0.0
    policy.cache.check_invariants(policy.indexes)


def test_serial_lanes_run_one_copy_at_a_time() -> None:
    policy = make_policy(
        layout=(1, 1, 1, 1, 2, 2), blocks_per_rank=64, cache=CacheManagerConfig(lanes="serial")
    )
    for rid in (1, 3):
        policy.arrive(request(rid, 200, seed=rid), 0.0)
    for worker in (4, 5):
        serve(policy, worker, 0.0)
    last = {rid: request(rid, 200, seed=rid).block_ids[-1] for rid in (1, 3)}
    (a,) = policy.queue_copy(policy.cache.plan_copy(last[1], 4, 1), 1.0).copies
    e_plan = policy.cache.plan_copy(last[3], 5, 3)  # disjoint devices, yet it waits
    assert not policy.queue_copy(e_plan, 1.0).copies
    assert policy.lanes.ready_s([0], 1.0) == pytest.approx(
        policy.lanes.timer.copy_s(12) + policy.lanes.timer.copy_s(12)
    )
    assert [j.plan.plan_id for j in policy.copy_done(a, True, 1.1).copies] == [e_plan.plan_id]
    with pytest.raises(ValueError, match="lanes must be 'device' or 'serial'"):
        CacheManagerConfig(lanes="links")


def test_routers_and_presets_are_checked_by_name() -> None:
    with pytest.raises(PolicyError, match="unknown router 'magic'; choose one of cache-first"):
        PolicyConfig(router="magic")
    with pytest.raises(PolicyError, match="unknown preset 'magic'; choose one of vertumnus"):
        preset("magic")
    assert preset("no-replication") == {
        "router": "vertumnus",
        "adaptive": False,
        "replication": False,
        "ideal_reuse": False,
    }
    for name in ROUTERS:
        assert PolicyConfig(router=name).router == name
    assert PolicyConfig(**preset("fixed")).name == "fixed"
    custom = PolicyConfig(router="cache-first", adaptive=True, replication=True)
    assert custom.name == "cache-first+adaptive+replication"


def test_the_profile_must_cover_the_pool() -> None:
    pool = PoolSpec(LatticeConfig(4, (1, 2, 4)), (4,), BLOCK_SIZE, 8)
    with pytest.raises(PolicyError, match="no degrees \\[4\\]"):
        PoolPolicy.build(make_profile(COEFFS, KAPPA_S), pool, PolicyConfig())
    pool = PoolSpec(LatticeConfig(2, (1, 2)), (1, 1), BLOCK_SIZE, 8)
    rules = PolicyConfig(controller=ControllerConfig(mode="rules"))
    with pytest.raises(PolicyError, match="no capacity kappa for degrees \\[1, 2\\]"):
        PoolPolicy.build(make_profile(COEFFS), pool, rules)
    # The what-if controller predicts from the coefficients: it needs no kappa.
    assert isinstance(PoolPolicy.build(make_profile(COEFFS), pool, PolicyConfig()).controller,
                      WhatIfController)  # fmt: skip
    fixed = PoolPolicy.build(make_profile(COEFFS), pool, PolicyConfig(adaptive=False))
    assert fixed.lattice.composition((WorkerState.ACTIVE,)) == {1: 2}


@pytest.mark.parametrize("fetch_at_switch", [True, False])
def test_a_split_keeps_the_prefix_its_worker_cached(fetch_at_switch: bool) -> None:
    """A degree-2 worker's prefix lies on both devices (block j on device j % 2): a
    child has the blocks of even depth only. Fetched right after the switch, the
    prefix is whole again at one child and its next request reuses all of it; left
    to a first reuse, which placement cannot see, that request reuses the one block
    adopted in place and recomputes the rest."""
    from vertumnus.policy.cache.retention import RetentionConfig

    retention = RetentionConfig(fetch_at_switch=fetch_at_switch)
    policy = make_policy(layout=(2,), retention=retention)
    n = 12 * BLOCK_SIZE + 5  # 12 whole blocks reusable
    policy.arrive(request(1, n), 0.0)
    serve(policy, 0, 0.0)
    _, actions = policy.begin_reshape(policy.lattice.split_options()[0], 1.0)
    switch = actions.switch
    assert switch is not None and switch.reserved_blocks > 0
    done = None
    for worker, devices in switch.workers:
        for rank in range(len(devices)):
            done = policy.acknowledge(switch.transition, worker, rank, 1.5)
    assert done is not None and done.activated == [switch.transition]
    fetches = [job for job in done.copies if job.plan.kind == "fetch"]
    assert len(fetches) == (1 if fetch_at_switch else 0)
    for job in fetches:
        policy.copy_done(job, True, 1.6)
    placed = policy.arrive(request(2, n), 2.0).placed
    assert len(placed) == 1
    started = policy.start(placed[0].worker_id, 2.0)
    assert started is not None
    expected = 12 * BLOCK_SIZE if fetch_at_switch else BLOCK_SIZE
    assert started.cached_tokens == expected
