"""Placement: exact decisions on hand-built pools."""

from __future__ import annotations

import pytest

from support.policy import COEFFS, cache_manager_for
from vertumnus.policy.cache_index import CacheReport
from vertumnus.policy.cache_manager import PrefixCacheManager
from vertumnus.policy.costs import CostWeights
from vertumnus.policy.lattice import Lattice, LatticeConfig, Reshape
from vertumnus.policy.scheduler import (
    PlacementRequest,
    Scheduler,
    SchedulerConfig,
    SchedulerError,
)

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
