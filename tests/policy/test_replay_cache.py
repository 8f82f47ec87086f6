"""The replay's cache model (``policy/replay_cache.py``): a prefix a replayed request
left is reusable where the replay ran it, pulled from there at the copy's cost, and
gone once evicted. Times use E_1(L, P) = (L - P) / 1024 (exact in binary)."""

from __future__ import annotations

from collections.abc import Sequence

from vertumnus.perfmodel import DegreeCoeffs
from vertumnus.policy.costs import CostWeights, reuse_curves
from vertumnus.policy.forecast import ArrivalSample
from vertumnus.policy.replay import ReplayModel, ReplayWorker
from vertumnus.policy.replay_cache import ReplayCache

CURVES = reuse_curves({1: DegreeCoeffs(c=2**-10)})
A, B = 0xA, 0xB  # leaf block ids


def sample(
    rid: int,
    t: float,
    n: int,
    *,
    link: int = 0,
    leaf: int = 0,
    matched: int = 0,
    holders: tuple[tuple[int, int], ...] = (),
) -> ArrivalSample:
    return ArrivalSample(rid, t, n, holders, 0, 0, matched, link, leaf)


def mean_ttft(
    samples: Sequence[ArrivalSample],
    n_workers: int,
    cache_tokens_per_rank: int | None = None,
    pull_s: tuple[float, float] | None = None,
) -> float:
    model = ReplayModel(CURVES, (1,), CostWeights(), None, 0.0, None, cache_tokens_per_rank, pull_s)
    pool = [ReplayWorker(k, 1, 0.0) for k in range(n_workers)]
    return model.run(model.prepare(samples, 0.0), pool).mean_ttft_s


def test_cache_holders_lru_and_eviction() -> None:
    cache = ReplayCache({0: 1500.0, 1: 0.0})
    assert cache.holders(A) is None  # nobody left it
    cache.store(0, 0, A, 1024)
    cache.store(1, 0, B, 1024)  # a worker that caches nothing keeps nothing
    assert cache.holders(A) == [0]
    assert cache.holders(B) is None
    cache.store(0, 0, B, 1024)  # 2048 > 1500: the least recently used goes
    assert cache.holders(A) == []  # left, then evicted: a miss, not unknown
    assert cache.holders(B) == [0]


def test_cache_reuse_refreshes_the_prefix() -> None:
    cache = ReplayCache({0: 2500.0})
    cache.store(0, 0, A, 1024)
    cache.store(0, 0, B, 1024)
    cache.store(0, A, 0xC, 0)  # reuses A (now the most recent), writes nothing new
    cache.store(0, 0, 0xD, 1024)  # 3072 > 2500: B, the least recent, goes
    assert cache.holders(A) == [0]
    assert cache.holders(B) == []


def test_a_linked_request_reuses_where_the_replay_ran_its_parent() -> None:
    # r0 (1024 tokens) runs on worker 0 over [0, 1]. r1 extends it (matched 1024)
    # and names worker 1 as a holder of 512 tokens at arrival; linked, it reuses
    # all 1024 on worker 0 (1.0), the holder it recorded is not one here.
    r0 = sample(0, 0.0, 1024, leaf=A)
    linked = sample(1, 1.0, 2048, link=A, leaf=B, matched=1024, holders=((1, 512),))
    assert mean_ttft([r0, linked], 2) == (1.0 + 1.0) / 2
    # Not linked: the holder it recorded serves it, reusing 512 (1.5).
    unlinked = sample(1, 1.0, 2048, leaf=B, matched=1024, holders=((1, 512),))
    assert mean_ttft([r0, unlinked], 2) == (1.0 + 1.5) / 2


def test_a_pull_brings_the_prefix_to_an_idle_worker() -> None:
    # r0 runs on worker 0 over [0, 1]; a long request keeps worker 1 busy over
    # [0, 8], and a long one extending r0 worker 0 over [1, 9]. r1 (matched 1024)
    # at 1.5 goes to idle worker 2: it waits for the 0.25-s copy and takes 1.0.
    # Without pulls it computes all 2048 tokens there (2.0).
    r0 = sample(0, 0.0, 1024, leaf=A)
    busy = [sample(1, 0.0, 8192), sample(2, 1.0, 9216, link=A, leaf=0xC, matched=1024)]
    r1 = sample(3, 1.5, 2048, link=A, leaf=B, matched=1024)
    assert mean_ttft([r0, *busy, r1], 3, pull_s=(0.25, 0.0)) == (1.0 + 8.0 + 8.0 + 1.25) / 4
    assert mean_ttft([r0, *busy, r1], 3) == (1.0 + 8.0 + 8.0 + 2.0) / 4


def test_an_evicted_prefix_is_computed() -> None:
    # One worker caching 1500 tokens: B evicts A before r2 comes back to it.
    r0 = sample(0, 0.0, 1024, leaf=A)
    r1 = sample(1, 0.0, 1024, leaf=B)
    r2 = sample(2, 10.0, 2048, link=A, matched=1024)
    assert mean_ttft([r0, r1, r2], 1, cache_tokens_per_rank=1500) == (1.0 + 2.0 + 2.0) / 3
    assert mean_ttft([r0, r1, r2], 1) == (1.0 + 2.0 + 1.0) / 3
