"""Placement: exact decisions on hand-built pools."""

from __future__ import annotations

import random

import pytest

from support.policy import COEFFS, cache_manager_for
from vertumnus.policy.cache.index import CacheReport
from vertumnus.policy.cache.manager import PrefixCacheManager
from vertumnus.policy.costs import CostWeights
from vertumnus.policy.geometry import LatticeConfig
from vertumnus.policy.lattice import Lattice, Reshape
from vertumnus.policy.placement.baselines import LeastLoadScheduler
from vertumnus.policy.placement.queues import PlacementRequest, SchedulerError
from vertumnus.policy.placement.scheduler import Scheduler, SchedulerConfig

# COEFFS: E_1(L, P) = 0.01 + 1 ms per uncached token; E_2 = 0.02 + 0.5 ms per uncached token.
B = 16


def make(
    config: SchedulerConfig | None = None, with_cache: bool = False
) -> tuple[Scheduler, PrefixCacheManager | None]:
    """Workers 0, 1 (degree 1, devices 0, 1) and 2 (degree 2, devices 2-3)."""
    lattice = Lattice(LatticeConfig(4, (1, 2)), [1, 1, 2])
    cache = cache_manager_for(lattice, COEFFS, B) if with_cache else None
    return Scheduler(lattice, COEFFS, config, cache), cache


def req(request_id: int, tokens: int = 100, blocks: tuple[int, ...] = ()) -> PlacementRequest:
    return PlacementRequest(request_id, tokens, blocks)


def test_cost_and_reservation_spread_arrivals() -> None:
    sched, _ = make()
    first = sched.place(req(1), now=0.0)
    assert first is not None
    # 100 tokens: E_1 = 0.11, E_2 = 0.07; nothing queued: degree 2 wins.
    assert (first.worker_id, first.exec_s, first.cost, first.num_candidates) == (
        2,
        pytest.approx(0.07),
        pytest.approx(0.07),
        3,
    )
    # The reservation is seen at once: 0.07 + 0.07 > 0.11, so worker 0 (tie with 1:
    # equal cost, load and degree -> the lower id).
    second = sched.place(req(2), now=0.0)
    assert second is not None and second.worker_id == 0 and second.queue_s == 0.0
    third = sched.place(req(3), now=0.0)
    assert third is not None and third.worker_id == 1
    sched.check(now=0.0)


def test_gpu_penalty_moves_work_to_smaller_degrees() -> None:
    sched, _ = make(SchedulerConfig(weights=CostWeights(gpu_penalty=1.0)))
    placed = sched.place(req(1), now=0.0)
    # Degree 2 costs (1 + 1 * (2/1 - 1)) * 0.07 = 0.14 > 0.11.
    assert placed is not None and placed.worker_id == 0
    assert placed.cost == pytest.approx(0.11)


def test_cache_first_until_the_queue_costs_more_than_the_hit() -> None:
    sched, cache = make(with_cache=True)
    assert cache is not None
    prefix = (101, 102, 103, 104)  # 64 tokens, held by worker 0
    cache.apply_report(CacheReport(0, inserted=prefix))
    a = sched.place(req(1, 100, prefix), now=0.0)
    # Worker 0 reuses 64 tokens: E = 0.01 + 0.036 = 0.046 < 0.07 at worker 2.
    assert a is not None and (a.worker_id, a.reused_tokens) == (0, 64)
    assert a.exec_s == pytest.approx(0.046)
    assert a.update is not None and a.update.reused_blocks == 4
    # Now worker 0 carries 0.046: 0.092 > 0.07, so the load wins over the hit.
    b = sched.place(req(2, 100, prefix), now=0.0)
    assert b is not None and (b.worker_id, b.reused_tokens) == (2, 0)
    # With worker 2 draining, the hit wins over idle worker 1 (0.092 < 0.11).
    sched.lattice.begin(Reshape("split", (2,), 1, (2, 3)))
    returned = sched.drain(2)
    assert [r.request_id for r in returned] == [2]
    c = sched.place(req(3, 100, prefix), now=0.0)
    assert c is not None and c.worker_id == 0 and c.num_candidates == 2
    # Time passes while worker 0 runs request 1: its remaining work counts, not more.
    sched.start(1, now=0.0)
    assert sched.outstanding_s(0, now=0.02) == pytest.approx(0.046 - 0.02 + 0.046)
    assert sched.outstanding_s(0, now=1.0) == pytest.approx(0.046)
    sched.complete(1)
    assert sched.outstanding_s(0, now=1.0) == pytest.approx(0.046)
    sched.check(now=1.0)


@pytest.mark.parametrize("backlog_weight", [0.0, 1.0])
def test_in_overload_a_hit_is_worth_the_work_it_saves_everyone_behind(
    backlog_weight: float,
) -> None:
    # Two degree-1 workers; fillers of 1000 tokens (E = 1.01) queue 4 at worker 0
    # and 3 at worker 1 (ties go to the lower id). Worker 0 holds 512 of a 640-token
    # request's tokens: E = 0.01 + 0.128 = 0.138 there, 0.65 at worker 1.
    lattice = Lattice(LatticeConfig(2, (1,)), [1, 1])
    cache = cache_manager_for(lattice, COEFFS, B)
    weights = CostWeights(backlog_weight=backlog_weight)
    sched = Scheduler(lattice, COEFFS, SchedulerConfig(weights), cache)
    prefix = tuple(range(101, 133))
    cache.apply_report(CacheReport(0, inserted=prefix))
    fillers = [sched.place(req(r, 1000), 0.0) for r in range(1, 8)]
    assert [p.worker_id for p in fillers if p is not None] == [0, 1, 0, 1, 0, 1, 0]
    placed = sched.place(req(9, 640, prefix), 0.0)
    assert placed is not None
    if backlog_weight == 0:
        # The plain rule: 4.04 + 0.138 = 4.178 at the holder > 3.03 + 0.65 = 3.68.
        assert (placed.worker_id, placed.reused_tokens) == (1, 0)
        assert placed.cost == pytest.approx(3.68)
    else:
        # Every queue holds at least 3 waiting requests, so about 2 will queue
        # behind this one wherever it goes: E weighs 1 + 1 * 2 = 3, and the 0.512 s
        # the hit saves is worth it: 4.04 + 3 * 0.138 = 4.454 < 3.03 + 3 * 0.65 = 4.98.
        assert (placed.worker_id, placed.reused_tokens) == (0, 512)
        assert placed.cost == pytest.approx(4.454)
    sched.check(0.0)


def test_the_backlog_term_sleeps_while_a_worker_has_at_most_one_waiting() -> None:
    # Both workers run a request; worker 0 queues 2 more, worker 1 one: the fewest
    # waiting is 1, so even a weight of 5 leaves the plain rule (3.03 + 0.138 at the
    # holder > 2.02 + 0.65 at worker 1; weighing E by 6 would turn it).
    lattice = Lattice(LatticeConfig(2, (1,)), [1, 1])
    cache = cache_manager_for(lattice, COEFFS, B)
    sched = Scheduler(lattice, COEFFS, SchedulerConfig(CostWeights(backlog_weight=5.0)), cache)
    prefix = tuple(range(101, 133))
    cache.apply_report(CacheReport(0, inserted=prefix))
    for rid, worker_id in ((1, 0), (2, 1), (3, 0), (4, 1), (5, 0)):
        placed = sched.place(req(rid, 1000), 0.0)
        assert placed is not None and placed.worker_id == worker_id
        if sched.running(worker_id) is None:
            sched.start(rid, 0.0)
    assert [len(sched.queued(w)) for w in (0, 1)] == [2, 1]
    placed = sched.place(req(9, 640, prefix), 0.0)
    assert placed is not None and (placed.worker_id, placed.reused_tokens) == (1, 0)
    assert placed.cost == pytest.approx(2.67)


def test_requests_too_long_for_a_worker_are_not_offered_to_it() -> None:
    sched, _ = make(SchedulerConfig(max_tokens_per_rank=60))
    placed = sched.place(req(1, tokens=100), now=0.0)  # 100 tokens need 2 ranks of 60
    assert placed is not None and placed.worker_id == 2 and placed.num_candidates == 1
    assert sched.place(req(2, tokens=121), now=0.0) is None  # fits nowhere


def test_fifo_and_errors() -> None:
    sched, _ = make()
    for rid in (1, 2, 3, 4):
        sched.place(req(rid), now=0.0)
    assert sched.queued(2) == [1, 4]
    with pytest.raises(SchedulerError, match="FIFO: 1 is first, not 4"):
        sched.start(4, now=0.0)
    with pytest.raises(SchedulerError, match="already placed"):
        sched.place(req(1), now=0.0)
    with pytest.raises(SchedulerError, match="not running"):
        sched.complete(1)
    sched.start(1, now=0.0)
    with pytest.raises(SchedulerError, match="already runs"):
        sched.start(4, now=0.0)
    assert sched.cancel(4).request_id == 4 and sched.queued(2) == []
    everything = sched.forget_worker(2)
    assert [r.request_id for r in everything] == [1]
    sched.check(now=0.0)
    with pytest.raises(SchedulerError, match="input_tokens"):
        sched.place(req(9, tokens=0), now=0.0)


def test_a_prefix_on_its_way_counts_where_it_is_being_built() -> None:
    """An agent's next step arrives while its predecessor waits: the worker that will
    have written the predecessor's blocks by the time the step starts (FIFO) prices
    it with them, and nothing is pulled for blocks that are only coming."""
    path = tuple(range(1, 13))  # 12 blocks, 192 tokens
    for coming_reuse in (True, False):
        sched, cache = make(SchedulerConfig(coming_reuse=coming_reuse), with_cache=True)
        assert cache is not None
        # 200 tokens: E_1 = 0.21, E_2 = 0.12 -> worker 2.
        first = sched.place(req(1, 200, path), now=0.0)
        assert first is not None and first.worker_id == 2
        step = sched.place(req(2, 220, (*path, 13)), now=0.0)
        assert step is not None
        if not coming_reuse:  # 0.12 + 0.13 at worker 2 > 0.23 at worker 0
            assert (step.worker_id, step.reused_tokens) == (0, 0)
            continue
        # Worker 2 brings 192 tokens of it: E_2 = 0.02 + 0.5 ms * 28; 0.154 < 0.23.
        assert (step.worker_id, step.reused_tokens) == (2, 192)
        assert step.exec_s == pytest.approx(0.034)
        assert step.cost == pytest.approx(0.154)
        assert step.update is not None and step.update.reused_blocks == 0
        assert step.update.fetch is None  # nothing is pulled for blocks on their way
        # At most what a prefill may reuse: 208 tokens of 13 blocks reuse 12 of them.
        same = sched.place(req(3, 208, (*path, 13)), now=0.0)
        assert same is not None and (same.worker_id, same.reused_tokens) == (2, 192)
        assert sched.coming_tokens(2, req(9, 220, (*path, 13))) == 208
        assert sched.coming_tokens(0, req(9, 220, (*path, 13))) == 0
        # What leaves the worker no longer comes there.
        sched.start(1, now=0.0)
        sched.complete(1)
        sched.cancel(2)
        sched.cancel(3)
        sched.check(now=0.1)
        assert sched.coming_tokens(2, req(9, 220, (*path, 13))) == 0
        # A worker's drained queue goes with it.
        sched.place(req(4, 200, path), now=0.1)
        assert sched.coming_tokens(2, req(9, 220, (*path, 13))) == 192
        assert [r.request_id for r in sched.forget_worker(2)] == [4]
        assert sched.coming_tokens(2, req(9, 220, (*path, 13))) == 0
        sched.check(now=0.1)


def test_baseline_routers_do_not_count_coming_prefixes() -> None:
    lattice = Lattice(LatticeConfig(4, (1, 2)), [1, 1, 2])
    sched = LeastLoadScheduler(lattice, COEFFS, None, cache_manager_for(lattice, COEFFS, B))
    path = tuple(range(1, 13))
    assert sched.place(req(1, 200, path), now=0.0) is not None
    assert sched.coming_tokens(2, req(2, 220, (*path, 13))) == 0
    sched.check(now=0.0)


def test_only_the_blocks_a_request_brings_beyond_what_its_worker_holds_are_indexed() -> None:
    sched, cache = make(with_cache=True)
    assert cache is not None
    path = tuple(range(1, 13))
    cache.apply_report(CacheReport(2, inserted=path[:4]))  # worker 2 holds 64 tokens
    first = sched.place(req(1, 200, path), now=0.0)
    # E_2 = 0.02 + 0.5 ms * 136 = 0.088 with the 64 held tokens.
    assert first is not None and (first.worker_id, first.reused_tokens) == (2, 64)
    step = req(2, 220, (*path, 13))
    assert sched.coming_tokens(2, step, held=64) == 192  # held 4, then 8 coming
    assert sched.coming_tokens(2, step, held=0) == 0  # the held blocks are the trie's
    placed = sched.place(step, now=0.0)
    assert placed is not None and (placed.worker_id, placed.reused_tokens) == (2, 192)
    assert placed.update is not None and placed.update.reused_blocks == 4
    sched.check(now=0.0)


def test_coming_prefixes_match_the_outstanding_requests_under_random_lives() -> None:
    """Random placements, starts, completions, cancels and drains of requests that
    share prefixes (a tree of chained blocks): after every step the index equals the
    one rebuilt from the outstanding requests, and the coming run of any path at any
    worker is the longest prefix it shares with a request outstanding there."""
    rng = random.Random(7)
    sched, _ = make(with_cache=True)  # (nothing is reported: every worker holds nothing)
    paths: list[tuple[int, ...]] = [()]
    for _ in range(40):  # a tree: each path extends an earlier one by 1-3 blocks
        base = rng.choice(paths)
        paths.append(base + tuple(rng.randrange(10**6) for _ in range(rng.randint(1, 3))))
    paths = paths[1:]
    placed: dict[int, PlacementRequest] = {}
    for rid in range(400):
        op = rng.random()
        if op < 0.5 or not placed:
            path = rng.choice(paths)
            request = req(rid, len(path) * B + rng.randint(1, B), path)
            if sched.place(request, now=0.0) is not None:
                placed[rid] = request
        elif op < 0.8:
            worker = rng.choice([0, 1, 2])
            head, running = sched.head(worker), sched.running(worker)
            if running is not None:
                sched.complete(running)
                placed.pop(running)
            elif head is not None:
                sched.start(head, now=0.0)
        elif op < 0.95:
            victim = rng.choice(sorted(placed))
            sched.cancel(victim)
            placed.pop(victim)
        else:
            for r in sched.drain(rng.choice([0, 1, 2])):
                placed.pop(r.request_id)
        sched.check(now=0.0)
        probe = rng.choice(paths)
        tokens = len(probe) * B + 1
        for worker in (0, 1, 2):
            mine = [
                r
                for r in placed.values()
                if sched.queued(worker).count(r.request_id) or sched.running(worker) == r.request_id
            ]
            shared = 0
            for r in mine:
                n = 0
                while n < min(len(r.block_ids), len(probe)) and r.block_ids[n] == probe[n]:
                    n += 1
                shared = max(shared, n)
            assert sched.coming_tokens(worker, req(-1, tokens, probe)) == shared * B


def test_a_running_prefill_is_counted_at_the_pace_measured() -> None:
    sched, _ = make()
    for rid in range(4):
        assert sched.place(req(rid), now=0.0) is not None
    # The profile is 2x fast at degree 2 (the policy stack measures it, ``Pace``).
    for _ in range(int(sched.pace.min_samples) + 2):  # (decayed: a few more)
        sched.pace.ended(2, 0.07, 0.14)
    assert sched.pace.of(2) == pytest.approx(0.5)
    rid = sched.head(2)
    assert rid is not None
    sched.start(rid, 1.0)
    # Halfway through a 0.07-s prefill that takes 0.14 s, 0.035 s of the profile's
    # are left: not 0, as the real seconds elapsed alone would say.
    queued = sched.queued_s(2)
    assert sched.outstanding_s(2, 1.07) == pytest.approx(queued + 0.035)
    assert sched.loads(1.07)[2] == pytest.approx(queued + 0.035)
    # ... and the next arrival's placement sees the same.
    placed = sched.place(req(9), now=1.07)
    assert placed is not None
    assert placed.queue_s == pytest.approx(queued + 0.035 if placed.worker_id == 2 else 0.0)
    sched.check(1.07)
