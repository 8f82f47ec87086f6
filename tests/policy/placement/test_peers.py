"""The peer routers (SGLang's cache-aware, Dynamo's KV, llm-d's scorers): each rule
by hand, exact worker ids. Workers 0, 1 (degree 1) and 2 (degree 2); blocks of 16
tokens; 8 KV blocks per rank, so workers 0 and 1 hold 8 blocks and worker 2 holds 16."""

from __future__ import annotations

from pathlib import Path

from support.policy import COEFFS, cache_manager_for
from vertumnus.policy.cache.index import CacheReport
from vertumnus.policy.cache.manager import PrefixCacheManager
from vertumnus.policy.geometry import LatticeConfig
from vertumnus.policy.lattice import Lattice
from vertumnus.policy.placement.peers import (
    DynamoKVScheduler,
    LLMDScheduler,
    SGLangCacheAwareScheduler,
)
from vertumnus.policy.placement.queues import PlacementRequest
from vertumnus.policy.placement.routers import ROUTERS
from vertumnus.policy.placement.scheduler import Scheduler, SchedulerConfig
from vertumnus.policy.pool_config import PRESETS, PolicyConfig

B = 16


def make(cls: type[Scheduler]) -> tuple[Scheduler, PrefixCacheManager]:
    lattice = Lattice(LatticeConfig(4, (1, 2)), [1, 1, 2])
    cache = cache_manager_for(lattice, COEFFS, B)
    return cls(lattice, COEFFS, SchedulerConfig(kv_blocks_per_rank=8), cache), cache


def req(request_id: int, tokens: int, blocks: tuple[int, ...] = ()) -> PlacementRequest:
    return PlacementRequest(request_id, tokens, blocks)


def place(sched: Scheduler, request: PlacementRequest) -> int:
    placed = sched.place(request, now=0.0)
    assert placed is not None
    return placed.worker_id


def test_the_peers_are_routers_and_presets_everywhere() -> None:
    for name in ("sglang-cache-aware", "dynamo-kv", "llm-d"):
        assert name in ROUTERS and PolicyConfig(router=name).router == name
        assert PRESETS[name] == {
            "router": name,
            "adaptive": False,
            "replication": False,
            "ideal_reuse": False,
        }


# -- SGLang ------------------------------------------------------------------------


def test_sglang_routes_an_imbalanced_pool_to_the_least_loaded() -> None:
    sched, _ = make(SGLangCacheAwareScheduler)
    sched.balance_abs_threshold = 2  # type: ignore[attr-defined]
    # Loads (requests outstanding) 0, 0, 0: balanced; no prefix anywhere, so the most
    # free cache: worker 2 (16 blocks).
    assert place(sched, req(1, 100)) == 2
    for rid in (2, 3):
        sched._reserve(req(rid, 100), 2, 0.1)  # worker 2 now has 3 outstanding
    # max - min = 3 > 2 and 3 > 1.5 * 0: imbalanced -> the least loaded (0, then id).
    assert place(sched, req(4, 100)) == 0


def test_sglang_follows_a_match_above_the_threshold_only() -> None:
    sched, _ = make(SGLangCacheAwareScheduler)
    workers = sched.lattice.workers
    prefix = (11, 12, 13)  # 48 tokens, routed to worker 1 before
    sched.route(workers[1], prefix)  # type: ignore[attr-defined]
    # 48 of 100 tokens: ratio 0.48 > 0.3 -> worker 1.
    assert place(sched, req(1, 100, prefix)) == 1
    # 48 of 200 tokens: 0.24 < 0.3 -> the most free room in the index: 8, 5, 16 -> 2.
    assert place(sched, req(2, 200, prefix)) == 2
    # Routing counts at once: worker 2's index now holds the 3 blocks; 11 more make
    # 14 of 16, so the free rooms are 8, 5, 2 -> worker 0.
    sched.route(workers[2], tuple(range(500, 511)))  # type: ignore[attr-defined]
    assert place(sched, req(3, 200, prefix)) == 0
    # An index is kept to its worker's capacity, the least recently routed out first.
    sched.route(workers[0], tuple(range(600, 612)))  # type: ignore[attr-defined]
    assert sched.routed_size(0) == 8  # type: ignore[attr-defined]
    assert sched.routed_match(0, (11, 12, 13)) == 0  # type: ignore[attr-defined]


# -- Dynamo ------------------------------------------------------------------------


def test_dynamo_costs_new_blocks_plus_active_blocks() -> None:
    sched, cache = make(DynamoKVScheduler)
    prefix = (21, 22, 23, 24)  # 4 blocks at worker 0
    cache.apply_report(CacheReport(0, inserted=prefix))
    # 100 tokens = 7 blocks. Costs: worker 0: 1 * (7 - 4) + 0 = 3; workers 1, 2: 7.
    assert place(sched, req(1, 100, prefix)) == 0
    # Now worker 0 has 7 active blocks: 3 + 7 = 10 against 7 at workers 1 and 2;
    # a tie between 1 and 2 goes to the lower id.
    assert place(sched, req(2, 100, prefix)) == 1
    # Worker 1: 7 + 7 = 14; worker 2: 7; worker 0: 10 -> worker 2.
    assert place(sched, req(3, 100, prefix)) == 2


def test_dynamo_active_blocks_follow_each_request_to_its_end() -> None:
    # Kept as requests come and go (not summed over the queue at each placement):
    # after every step the count equals the blocks of the worker's queued and running
    # prompts, and check() agrees.
    sched, _ = make(DynamoKVScheduler)
    tokens = {1: 100, 2: 33, 3: 16, 4: 250, 5: 17, 6: 64}
    for rid, n in tokens.items():
        place(sched, req(rid, n))

    def recount(worker_id: int) -> int:
        ids = sched.queued(worker_id)
        run = sched.running(worker_id)
        ids += [] if run is None else [run]
        return sum(-(-tokens[r] // B) for r in ids)

    def agree() -> None:
        for w in (0, 1, 2):
            assert sched.active_blocks(w) == recount(w)  # type: ignore[attr-defined]
        sched.check(0.0)

    agree()
    assert sum(sched.active_blocks(w) for w in (0, 1, 2)) == 7 + 3 + 1 + 16 + 2 + 4  # type: ignore[attr-defined]
    sched.start(1, 0.0)
    agree()
    sched.complete(1)
    agree()
    sched.cancel(4)
    agree()
    for worker_id in (0, 1, 2):
        sched.drain(worker_id)
    agree()
    assert all(sched.active_blocks(w) == 0 for w in (0, 1, 2))  # type: ignore[attr-defined]


def test_dynamo_weight_and_temperature() -> None:
    sched, cache = make(DynamoKVScheduler)
    cache.apply_report(CacheReport(0, inserted=(31, 32)))
    sched._reserve(req(9, 64), 0, 0.1)  # worker 0: 4 active blocks
    # 64 tokens = 4 blocks. Weight 1: worker 0 costs (4 - 2) + 4 = 6, others 4 -> 1.
    assert place(sched, req(1, 64, (31, 32))) == 1
    heavy, cache = make(DynamoKVScheduler)
    heavy.overlap_score_weight = 3.0  # type: ignore[attr-defined]
    cache.apply_report(CacheReport(0, inserted=(31, 32)))
    heavy._reserve(req(9, 64), 0, 0.1)
    # Weight 3: worker 0: 3 * 2 + 4 = 10; workers 1 and 2: 3 * 4 = 12 -> worker 0.
    assert place(heavy, req(1, 64, (31, 32))) == 0
    # A temperature samples: over many requests every worker is chosen sometimes.
    warm, _ = make(DynamoKVScheduler)
    warm.temperature = 50.0  # type: ignore[attr-defined]
    chosen = {place(warm, req(rid, 16)) for rid in range(60)}
    assert chosen == {0, 1, 2}


# -- llm-d -------------------------------------------------------------------------


def test_llmd_weighs_prefix_queue_and_cache_room() -> None:
    sched, cache = make(LLMDScheduler)
    prefix = (41, 42, 43, 44, 45, 46)  # 6 blocks: routed to worker 1, cached there
    sched.route(sched.lattice.workers[1], prefix)  # type: ignore[attr-defined]
    cache.apply_report(CacheReport(1, inserted=prefix))
    # 100 tokens = 7 blocks. Queues all 0 -> queue score 1 everywhere.
    # worker 0: 3 * 0 + 2 * 1 + 2 * (1 - 0/8) = 4
    # worker 1: 3 * 6/7 + 2 + 2 * (1 - 6/8) = 2.571 + 2 + 0.5 = 5.071
    # worker 2: 0 + 2 + 2 * 1 = 4
    assert place(sched, req(1, 100, prefix)) == 1
    # Three waiting at worker 1 (queue score 0), none elsewhere (1):
    for rid in (2, 3):
        sched._reserve(req(rid, 100), 1, 0.1)
    # worker 1: 2.571 + 0 + 0.5 = 3.071; workers 0 and 2: 4 (tie -> the lower id 0).
    assert place(sched, req(4, 100, prefix)) == 0


def test_llmd_queue_score_is_min_max_normalised() -> None:
    sched, _ = make(LLMDScheduler)
    sched._reserve(req(1, 100), 0, 0.1)
    sched._reserve(req(2, 100), 0, 0.1)
    sched._reserve(req(3, 100), 1, 0.1)
    # Waiting: 2, 1, 0 -> queue scores 0, 0.5, 1; empty caches: 2 each -> worker 2.
    assert place(sched, req(4, 100)) == 2
    assert sched.outstanding_s(2, 0.0) > 0


def test_serve_and_simulate_read_the_peer_routers(tmp_path: Path) -> None:
    from vertumnus.policy.pool_policy import PoolPolicy
    from vertumnus.runtime import serve_config
    from vertumnus.sim import config as sim_config

    path = tmp_path / "pool.toml"
    path.write_text('[scheduler]\nrouter = "dynamo-kv"\n')
    served = serve_config.load(path)
    assert served.policy.router == "dynamo-kv"
    raw = {"workload": {"phases": [{"duration_s": 10, "rate": 5}]}}
    simulated = sim_config.load(None, {}, raw=raw, preset="llm-d")
    assert (simulated.policy.router, simulated.policy.adaptive) == ("llm-d", False)
    policy = PoolPolicy.build(simulated.profile, simulated.spec, simulated.policy)
    assert isinstance(policy.scheduler, LLMDScheduler)
