"""Pulls: a request placed where its prefix is not held has the prefix copied there
when the copy costs less than computing it, waits for it, and finds it pinned; and
the ideal-replication bound, which the simulator measures pulls against."""

from __future__ import annotations

from pathlib import Path

import pytest

from support.factories import BLOCK_SIZE, make_profile
from support.policy import COEFFS, KAPPA_S
from vertumnus.blocks import block_ids
from vertumnus.config import ConfigError
from vertumnus.policy.cache.audit import CopyAudit
from vertumnus.policy.cache.copy_cost import CopyTimer, EvictionValue
from vertumnus.policy.cache.plans import CopyPlan, ReclaimPlan, ScanResult
from vertumnus.policy.geometry import LatticeConfig
from vertumnus.policy.placement.queues import PlacementRequest
from vertumnus.policy.pool_config import PolicyConfig, PolicyError, PoolSpec, preset
from vertumnus.policy.pool_policy import PoolPolicy
from vertumnus.runtime import serve_config


def make_policy(**config: object) -> PoolPolicy:
    pool = PoolSpec(LatticeConfig(4, (1, 2)), (2, 2), BLOCK_SIZE, 256)
    return PoolPolicy.build(make_profile(COEFFS, KAPPA_S), pool, PolicyConfig(**config))  # type: ignore[arg-type]


def request(rid: int, n: int, seed: int = 0) -> PlacementRequest:
    tokens = [(seed * 7919 + i) % 997 for i in range(n)]
    return PlacementRequest(rid, n, tuple(block_ids(tokens, BLOCK_SIZE)))


def hot_prefix_elsewhere(policy: PoolPolicy) -> None:
    """Worker 0 holds request 1's 12 blocks and is busy with a long prefill."""
    policy.arrive(request(1, 200), 0.0)
    started = policy.start(0, 0.0)
    assert started is not None
    policy.finish(0, started.exec_s)
    policy.arrive(request(2, 1500, seed=5), 1.0)
    assert policy.scheduler.head(0) == 2
    assert policy.start(0, 1.0) is not None


def test_a_pull_brings_the_prefix_and_the_request_waits_for_it() -> None:
    policy = make_policy(adaptive=False)
    hot_prefix_elsewhere(policy)
    actions = policy.arrive(request(3, 300), 1.1)
    (placed,) = actions.placed
    assert placed.worker_id == 1
    assert placed.reused_tokens == 12 * BLOCK_SIZE  # promised: the whole MatchedPath
    (job,) = actions.copies
    assert job.plan.kind == "pull" and job.plan.dest_worker == 1
    assert [m.src_worker for m in job.plan.moves] == [0] * 12
    # The source's copy is pinned while the pull waits or runs.
    assert not policy.indexes[0].can_reclaim(job.plan.block_id)
    assert policy.start(1, 1.1) is None  # waiting for its prefix
    done = policy.copy_done(job, True, 1.2)
    assert done.woken == [1] and done.copies_ended == [(job.plan.plan_id, 12)]
    # Pinned at the destination until the request starts: nothing can evict it.
    assert not policy.indexes[1].can_reclaim(job.plan.block_id)
    assert policy.indexes[0].can_reclaim(job.plan.block_id)  # the source's pin is gone
    started = policy.start(1, 1.2)
    assert started is not None and started.request_id == 3
    assert started.cached_tokens == placed.reused_tokens
    assert started.exec_s == pytest.approx(placed.exec_s)
    policy.finish(1, 1.3)
    assert policy.indexes[1].can_reclaim(request(3, 300).block_ids[17])  # its own leaf
    policy.cache.check_invariants(policy.indexes)
    assert policy.pulls.pinned == 0
    assert policy.lanes.timer.measured == 1  # the copy taught the copy time model
    pulls = policy.cache.audit.summary()["pull"]
    assert (pulls["installed_blocks"], pulls["used_blocks"], pulls["hits"]) == (12, 12, 1)
    assert pulls["waste_fraction"] == 0.0


def test_a_pulled_prefix_is_pinned_before_the_next_copy_allocates() -> None:
    """The copy queued behind a pull starts when the pull ends; where the destination
    is full it evicts least recently used leaves, and the pulled prefix (just
    committed, unpinned) would be the first to go before the request waiting for it
    starts. The pin comes first."""
    policy = make_policy(adaptive=False)
    hot_prefix_elsewhere(policy)
    (pull,) = policy.arrive(request(3, 300), 1.1).copies
    assert pull.plan.kind == "pull" and pull.plan.dest_worker == 1
    last = pull.plan.block_id
    shorter = request(3, 300).block_ids[5]
    # A copy to the same destination waits for the pull's lanes.
    assert not policy.queue_copy(policy.cache.plan_copy(shorter, 0, 1), 1.1).copies
    seen: list[bool] = []
    begin = policy.ledger.begin_copy

    def begin_copy(plan: CopyPlan) -> object:
        seen.append(policy.indexes[1].can_reclaim(last))
        return begin(plan)

    policy.ledger.begin_copy = begin_copy  # type: ignore[method-assign]
    policy.copy_done(pull, True, 1.2)
    assert seen == [False]  # pinned for request 3 when the next copy began
    started = policy.start(1, 1.2)
    assert started is not None and started.cached_tokens == 12 * BLOCK_SIZE


def test_a_pull_reads_from_the_holder_whose_devices_are_free() -> None:
    pool = PoolSpec(LatticeConfig(4, (1, 2)), (1, 1, 1, 1), BLOCK_SIZE, 256)
    policy = PoolPolicy.build(make_profile(COEFFS, KAPPA_S), pool, PolicyConfig(adaptive=False))
    prefix = request(1, 200)
    (first,) = policy.arrive(prefix, 0.0).placed
    started = policy.start(first.worker_id, 0.0)
    assert started is not None
    policy.finish(first.worker_id, started.exec_s)
    last = prefix.block_ids[11]
    a, b, c, d = [first.worker_id] + [w for w in range(4) if w != first.worker_id]
    (copy,) = policy.queue_copy(policy.cache.plan_copy(last, a, b), 1.0).copies
    policy.copy_done(copy, True, 1.0)  # a and b hold the prefix
    (busy,) = policy.queue_copy(policy.cache.plan_copy(last, a, c), 1.0).copies  # a's device
    lookup = policy.cache.lookup(prefix.block_ids, 300)
    # The price of a pull to d: the first free holder (b), not the copy under way on a.
    delay_s, _ = policy.scheduler.pull_cost(lookup.path, 12, d, 1.0)  # type: ignore[misc]
    assert delay_s == pytest.approx(policy.lanes.timer.copy_s(12))
    assert policy.pulls.source_s(policy.cache.trie.worker(a), 1.0) > 0
    update = policy.cache.on_request(prefix.block_ids, 300, d, lookup, 12 * BLOCK_SIZE, 1.0)
    assert update.fetch is not None and update.fetch.kind == "pull"
    assert {m.src_worker for m in update.fetch.moves} == {b}
    (pull,) = policy.queue_copy(update.fetch, 1.0).copies  # at once, beside the other
    assert set(policy.lanes.running) == {busy.plan.plan_id, pull.plan.plan_id}


def test_no_pull_without_the_cache_manager_or_when_the_worker_holds_it() -> None:
    off = make_policy(**preset("no-replication"))
    hot_prefix_elsewhere(off)
    actions = off.arrive(request(3, 300), 1.1)
    assert not actions.copies and actions.placed[0].reused_tokens in (0, 12 * BLOCK_SIZE)
    assert off.pulls.pinned == 0
    # Idle holder: the request goes where its prefix is; nothing moves.
    on = make_policy(adaptive=False)
    on.arrive(request(1, 200), 0.0)
    started = on.start(0, 0.0)
    assert started is not None
    on.finish(0, started.exec_s)
    actions = on.arrive(request(3, 300), 1.0)
    assert actions.placed[0].worker_id == 0 and not actions.copies


def test_a_placed_request_keeps_its_prefix_pinned_until_it_starts() -> None:
    policy = make_policy(adaptive=False)
    policy.arrive(request(1, 200), 0.0)
    started = policy.start(0, 0.0)
    assert started is not None
    policy.finish(0, started.exec_s)
    policy.arrive(request(2, 1500, seed=5), 1.0)  # worker 0 busy
    assert policy.start(0, 1.0) is not None
    policy.arrive(request(4, 1500, seed=9), 1.0)  # worker 1 busy
    assert policy.start(1, 1.0) is not None
    # The prefix holder (worker 0) is still cheapest: queued there, its prefix pinned.
    (placed,) = policy.arrive(request(3, 300), 1.1).placed
    assert placed.worker_id == 0 and placed.reused_tokens == 12 * BLOCK_SIZE
    last = request(1, 200).block_ids[11]
    assert not policy.indexes[0].can_reclaim(last)
    policy.abandon(3, 1.2)  # the client gave up: the pin goes
    assert policy.indexes[0].can_reclaim(last) and policy.pulls.pinned == 0


def test_the_copy_time_model_learns_from_measured_copies() -> None:
    timer = CopyTimer(latency_s=0.001, block_s=0.01, weight=0.5)
    assert timer.copy_s(10) == pytest.approx(0.101)
    timer.observe(10, 0.021)  # 2 ms per block measured
    assert timer.block_s == pytest.approx(0.006) and timer.measured == 1
    timer.observe(0, 5.0)  # nothing moved: no lesson
    assert timer.measured == 1


def test_an_eviction_costs_what_lost_blocks_would_have_saved() -> None:
    value = EvictionValue(max_ghosts=2)
    assert value.value_s == 0.0
    value.evicted_block(11, last_copy=True)
    value.evicted_block(12, last_copy=False)  # a copy remains elsewhere: no ghost
    value.evicted_block(13, last_copy=True)
    # A request whose MatchedPath ends at depth 1 continues into ghost 11 (depth 1),
    # then into 99, not a ghost: one block would have saved 1.0 + 0.5 * 1 seconds.
    value.missed([7, 11, 99, 13], 1, 4, base_s=1.0, step_s=0.5)
    assert value.ghost_benefit_s == pytest.approx(1.5)
    assert value.value_s == pytest.approx(1.5 / 3)
    value.inserted(11)  # computed again: no longer lost
    value.missed([7, 11], 1, 2, base_s=1.0, step_s=0.5)
    assert value.ghost_benefit_s == pytest.approx(1.5)
    value.evicted_block(14, last_copy=True)
    value.evicted_block(15, last_copy=True)  # only the 2 most recent ghosts are kept
    value.missed([13], 0, 1, base_s=1.0, step_s=0.5)
    assert value.ghost_benefit_s == pytest.approx(1.5)
    value.decay(0.5)
    assert value.evicted == pytest.approx(2.5) and value.ghost_benefit_s == pytest.approx(0.75)


def test_ideal_replication_reuses_what_is_cached_anywhere() -> None:
    policy = make_policy(**preset("ideal-replication"))
    assert policy.config.name == "ideal-replication"
    hot_prefix_elsewhere(policy)
    actions = policy.arrive(request(3, 300), 1.1)
    (placed,) = actions.placed
    assert placed.worker_id == 1 and placed.reused_tokens == 12 * BLOCK_SIZE
    assert not actions.copies  # free and at once: nothing moves, nothing waits
    started = policy.start(1, 1.1)
    assert started is not None and started.cached_tokens == 12 * BLOCK_SIZE
    policy.finish(1, 1.2)
    policy.cache.check_invariants(policy.indexes)
    assert 1 in {
        h.worker_id
        for h in policy.cache.trie.holders_of(
            policy.cache.trie.nodes[request(1, 200).block_ids[11]]
        )
    }


def test_ideal_replication_is_a_simulator_bound(tmp_path: Path) -> None:
    with pytest.raises(PolicyError, match="turn replication off"):
        PolicyConfig(ideal_reuse=True)
    path = tmp_path / "serve.toml"
    path.write_text("[cache]\nreplication = false\nideal = true\n")
    with pytest.raises(ConfigError, match="bound the simulator computes"):
        serve_config.load(path)
    with pytest.raises(ConfigError, match="bound the simulator computes"):
        serve_config.load(None, preset="ideal-replication")


def test_the_audit_follows_each_copied_block_to_a_hit_or_its_eviction() -> None:
    audit = CopyAudit()
    plan = CopyPlan(7, "intra", 3, 20, 1, (1, 2, 3), (), False, 5.0, benefit_s=0.2)
    reclaim = ReclaimPlan(8, 21, 9, 1, 0.0, loss_s=0.01)
    record = audit.scanned(5.0, ScanResult((plan,), (reclaim,), {"intra": 1}), reclaimed=1)
    assert (record.copies, record.predicted_benefit_s, record.reclaims) == (1, 0.2, 1)
    audit.installed(plan, [2, 3])  # block 1 was there already
    audit.finished(plan.plan_id)
    audit.reused(20, [1, 2])  # one request reuses block 2 (a hit) ...
    audit.reused(20, [1, 2])  # ... and another
    audit.reused(21, [3])  # another worker's block 3: not this copy's
    audit.evicted(20, 3)  # block 3 leaves unused: waste
    audit.evicted(20, 2)  # block 2 leaves after its hits: used
    assert (record.hits, record.used_blocks, record.wasted_blocks) == (2, 1, 1)
    summary = audit.summary()
    assert summary["intra"]["waste_fraction"] == 0.5 and summary["all"]["hits"] == 2
    assert summary["all"]["live_unused_blocks"] == 0
    audit.installed(plan, [4])
    audit.forget_worker(20)  # the worker left: neither used nor wasted
    assert audit.summary()["intra"]["wasted_blocks"] == 1
