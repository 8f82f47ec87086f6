"""The host KV tier (``policy/cache/host_tier.py``) and the policy stack around it:
evictions demoted, runs loaded back when cheaper than computing them, placement's
price, Dynamo's credit, the bound, the configuration's checks."""

from __future__ import annotations

import math

import pytest

from support.factories import BLOCK_SIZE, make_profile
from support.policy import CACHE_COEFFS, KAPPA_S
from vertumnus.blocks import block_ids
from vertumnus.perfmodel import Profile, ProfileError
from vertumnus.policy.cache.host_slots import HostSlots, TierStats, sweep
from vertumnus.policy.cache.host_tier import HostLink, HostTierPolicy
from vertumnus.policy.cache.plans import CacheManagerConfig
from vertumnus.policy.geometry import LatticeConfig
from vertumnus.policy.placement.queues import PlacementRequest
from vertumnus.policy.pool_config import PolicyConfig, PolicyError, PoolSpec
from vertumnus.policy.pool_policy import PoolPolicy

BLOCK_BYTES = 1_000_000  # 20 us a block each way at the default 50 GB/s


def make_policy(
    layout: tuple[int, ...] = (1,),
    blocks_per_rank: int = 4,
    tier_blocks: int = 100,
    bound: bool = False,
    devices_per_host: int = 1,
    h2d_bytes_s: float | None = None,
    net_bytes_s: float = 0.0,
    **config: object,
) -> PoolPolicy:
    pool = PoolSpec(
        LatticeConfig(sum(layout), (1, 2)),
        layout,
        BLOCK_SIZE,
        blocks_per_rank,
        block_bytes=BLOCK_BYTES,
        devices_per_host=devices_per_host,
        net_bytes_s=net_bytes_s,
    )
    profile = make_profile(CACHE_COEFFS, KAPPA_S)
    if h2d_bytes_s is not None:
        profile.host_link = {"h2d_bytes_s": h2d_bytes_s}
    cache = CacheManagerConfig(host_tier_bytes=tier_blocks * BLOCK_BYTES, host_tier_bound=bound)
    return PoolPolicy.build(profile, pool, PolicyConfig(cache=cache, **config))  # type: ignore[arg-type]


def prompt(rid: int, n: int, seed: int) -> PlacementRequest:
    tokens = [(seed * 7919 + i * 31) % 997 for i in range(n)]
    return PlacementRequest(rid, n, tuple(block_ids(tokens, BLOCK_SIZE)))


def run(policy: PoolPolicy, req: PlacementRequest, now: float, worker: int | None = None):  # type: ignore[no-untyped-def]
    """Place ``req`` and run its prefill to the end; its ``Started``."""
    actions = policy.arrive(req, now)
    placed = actions.placed[0].worker_id if actions.placed else worker
    assert placed is not None
    started = policy.start(placed, now)
    assert started is not None and started.request_id == req.request_id
    policy.finish(placed, now + started.exec_s)
    return started


# -- the tier itself -------------------------------------------------------------------


def test_a_full_tier_evicts_its_least_recently_used_block() -> None:
    tier, stats = HostSlots(capacity=2), TierStats()
    assert tier.insert(10, 0.0, stats) == (0, None)
    assert tier.insert(11, 0.0, stats) == (1, None)
    tier.touch([10])  # 11 is now the oldest
    assert tier.insert(12, 0.0, stats) == (1, 11)  # (11's slot)
    assert 11 not in tier and 10 in tier and 12 in tier
    assert stats.evicted_blocks == 1 and stats.peak_blocks == 2


def test_demotions_queue_on_the_device_to_host_lane_and_load_when_written() -> None:
    link = HostLink(BLOCK_BYTES, d2h_bytes_s=1e6, h2d_bytes_s=2e6, devices_per_host=2)
    tiers = HostTierPolicy(10 * BLOCK_BYTES, link)
    moves = tiers.demote(first_device=1, evicted=[(7, 0, 3), (6, 0, 2)], now=5.0)
    assert [(m.host, m.block_id, m.slot) for m in moves] == [(0, 7, 3), (0, 6, 2)]
    assert tiers.stats.d2h_busy_s == pytest.approx(2.0)  # 1 s a block at 1 MB/s
    ids = [6, 7]
    assert tiers.run(0, ids, 0, 2, now=5.5) == 0  # nothing written back yet
    assert tiers.run(0, ids, 0, 2, now=6.0) == 0  # 7 is, 6 (the parent) is not
    assert tiers.run(0, ids, 0, 2, now=7.0) == 2
    assert tiers.run(2, ids, 0, 2, now=7.0) == 0  # another host's tier: not used
    assert tiers.demote(0, [(7, 0, 1)], now=8.0) == []  # held already: refreshed only
    assert tiers.holding([5, 6, 7], 3)[0] == 0b1 and tiers.holding([5], 1)[0] == 0
    tiers.demote(2, [(6, 0, 0)], now=8.0)  # host 1 holds 6 as well
    assert tiers.holding([6], 1)[0] == 0b11
    assert sweep(tiers.holding([6, 7, 5], 3)[1], 0, 0b11) == {0: 2, 1: 1}
    assert sweep(tiers.holding([6, 7, 5], 3)[1], 1, 0b11) == {0: 1, 1: 0}
    # Each rank of a degree-C worker loads its own blocks, at once.
    assert tiers.load_s(5, 2) == pytest.approx(3 * BLOCK_BYTES / 2e6)


def test_no_tier_when_not_asked_or_smaller_than_a_block() -> None:
    assert not HostTierPolicy(0, None).enabled
    small = HostTierPolicy(2 * BLOCK_BYTES, HostLink(BLOCK_BYTES))
    small.demote(0, [(1, 0, 0), (2, 0, 1), (3, 0, 2)], now=0.0)  # 1 is evicted for 3
    assert small.holding([1], 1)[0] == 0 and small.holding([3], 1)[0] == 1
    assert not HostTierPolicy(BLOCK_BYTES - 1, HostLink(BLOCK_BYTES)).enabled
    assert HostTierPolicy(BLOCK_BYTES, HostLink(BLOCK_BYTES)).capacity_blocks == 1


# -- the policy stack ------------------------------------------------------------------


def test_an_evicted_prefix_is_loaded_back_from_the_host_tier() -> None:
    policy = make_policy()
    a = prompt(1, 50, seed=1)  # 3 whole blocks usable
    first = run(policy, a, 0.0)
    assert first.cached_tokens == 0 and not first.demotions
    b = run(policy, prompt(2, 50, seed=2), 1.0)  # needs 3 of the 4 slots: evicts 2 of A's
    assert [d.block_id for d in b.demotions] == [a.block_ids[2], a.block_ids[1]]
    again = run(policy, prompt(3, 50, seed=1), 2.0)
    assert again.allocation.num_reused_blocks == 1  # block 0 stayed on the rank
    assert [x.block_id for x in again.loads] == [a.block_ids[1], a.block_ids[2]]
    assert again.allocation.loaded == 2 and again.cached_tokens == 3 * BLOCK_SIZE
    assert again.loaded_tokens == 2 * BLOCK_SIZE
    curve = policy.curves[1]
    load_s = policy.tiers.load_s(2, 1)
    assert load_s == pytest.approx(2 * BLOCK_BYTES / 50e9)
    assert again.exec_s == pytest.approx(curve.time_s(50, 3 * BLOCK_SIZE) + load_s)
    # The loads' targets are the allocation's first new blocks, where the prefill reads them.
    assert [(x.rank, x.slot) for x in again.loads] == [
        (loc.rank, loc.slot) for loc in again.allocation.new[:2]
    ]
    assert policy.tiers.stats.loaded_blocks == 2


def test_without_a_tier_the_evicted_prefix_is_computed() -> None:
    policy = make_policy(tier_blocks=0)
    run(policy, prompt(1, 50, seed=1), 0.0)
    run(policy, prompt(2, 50, seed=2), 1.0)
    again = run(policy, prompt(3, 50, seed=1), 2.0)
    assert again.cached_tokens == BLOCK_SIZE and not again.loads and not again.demotions


def test_a_load_slower_than_computing_is_not_made() -> None:
    policy = make_policy(h2d_bytes_s=1e3)  # 1,000 s a block
    run(policy, prompt(1, 50, seed=1), 0.0)
    run(policy, prompt(2, 50, seed=2), 1.0)
    again = run(policy, prompt(3, 50, seed=1), 2.0)
    assert not again.loads and again.allocation.loaded == 0
    assert again.cached_tokens == BLOCK_SIZE


def _busy_worker_0_with_a_in_its_tier(
    tier_blocks: int, net_bytes_s: float = 0.0
) -> tuple[PoolPolicy, float]:
    """Two workers of degree 1, one host each. Prompt A runs on worker 0, two others
    evict it there (into host 0's tier, if it has one); a short prompt then runs on
    worker 0, so worker 0 is busy and worker 1 idle when A comes again."""
    policy = make_policy(
        layout=(1, 1), blocks_per_rank=4, tier_blocks=tier_blocks, net_bytes_s=net_bytes_s
    )
    for rid, seed in ((1, 1), (2, 2), (3, 3)):
        assert run(policy, prompt(rid, 50, seed), float(rid)).worker_id == 0  # (ties: 0)
    assert not policy.indexes[0].match(prompt(0, 50, seed=1).block_ids)
    policy.arrive(prompt(4, 20, seed=4), 10.0)
    assert policy.start(0, 10.0) is not None  # worker 0 runs it: about 0.03 s of work
    return policy, 10.0


def test_placement_prices_the_host_tier_of_each_worker() -> None:
    policy, now = _busy_worker_0_with_a_in_its_tier(tier_blocks=100)
    a = prompt(9, 50, seed=1)
    assert all(bid in policy.tiers.tiers[0] for bid in a.block_ids)
    placed = policy.arrive(a, now).placed[0]
    # Worker 0's wait plus computing 2 tokens beats worker 1 computing all 50.
    assert placed.worker_id == 0 and placed.reused_tokens == 3 * BLOCK_SIZE
    assert dict(placed.holders)[0] == 3 * BLOCK_SIZE  # (the what-if replay sees it)
    # Without a tier, the idle worker wins.
    policy, now = _busy_worker_0_with_a_in_its_tier(tier_blocks=0)
    assert policy.arrive(a, now).placed[0].worker_id == 1


def test_another_hosts_tier_is_read_over_the_network() -> None:
    # A is in host 0's tier only; worker 0 (host 0) is busy, worker 1 (host 1) idle.
    policy, now = _busy_worker_0_with_a_in_its_tier(tier_blocks=100, net_bytes_s=25e9)
    a = prompt(9, 50, seed=1)
    placed = policy.arrive(a, now).placed[0]
    assert placed.worker_id == 1 and placed.reused_tokens == 3 * BLOCK_SIZE
    started = policy.start(1, now)
    assert started is not None and started.request_id == 9
    assert [(x.host, x.block_id) for x in started.loads] == [(0, b) for b in a.block_ids]
    # Its ranks read the three blocks over the network, at 25 GB/s.
    assert started.load_s == pytest.approx(3 * BLOCK_BYTES / 25e9)
    assert policy.tiers.stats.remote_blocks == 3
    # Without the network read, worker 1 would compute it all: worker 0 waits less.
    policy, now = _busy_worker_0_with_a_in_its_tier(tier_blocks=100)
    assert policy.arrive(a, now).placed[0].worker_id == 0


def test_dynamo_credits_host_tier_hits() -> None:
    policy = make_policy(layout=(1, 1), router="dynamo-kv", adaptive=False, replication=False)
    scheduler = policy.scheduler
    req = prompt(1, 50, seed=1)
    # Host 1's tier holds the request's three blocks (as if evicted there).
    policy.tiers.demote(1, [(bid, 0, i) for i, bid in enumerate(req.block_ids)], 0.0)
    w0, w1 = policy.lattice.workers[0], policy.lattice.workers[1]
    assert scheduler.tier_blocks(w1, req, 0, 1.0) == 3
    assert scheduler.tier_blocks(w0, req, 0, 1.0) == 0
    assert policy.arrive(req, 1.0).placed[0].worker_id == 1


def test_the_bound_makes_every_committed_block_loadable_everywhere() -> None:
    policy = make_policy(layout=(1, 1), blocks_per_rank=8, bound=True)
    a = prompt(1, 50, seed=1)
    first = run(policy, a, 0.0)
    other = 1 - first.worker_id
    assert policy.tiers.run(policy.lattice.workers[other].first_device, a.block_ids, 0, 3, 0.1) == 3
    assert policy.tiers.capacity_blocks is None


# -- configuration ---------------------------------------------------------------------


def test_the_tier_needs_a_block_size_in_bytes() -> None:
    pool = PoolSpec(LatticeConfig(1, (1,)), (1,), BLOCK_SIZE, 4)
    profile = make_profile(CACHE_COEFFS, KAPPA_S)
    config = PolicyConfig(cache=CacheManagerConfig(host_tier_bytes=10**9))
    with pytest.raises(PolicyError, match="kv_bytes_per_token"):
        PoolPolicy.build(profile, pool, config)
    profile.host_link = {"kv_bytes_per_token": 1000}
    policy = PoolPolicy.build(profile, pool, config)
    assert policy.tiers.capacity_blocks == 10**9 // (1000 * BLOCK_SIZE)


def test_host_tier_bytes_is_whole_and_not_negative() -> None:
    assert CacheManagerConfig(host_tier_bytes=1e12).host_tier_bytes == 10**12  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="host_tier_bytes"):
        CacheManagerConfig(host_tier_bytes=-1)
    with pytest.raises(ValueError, match="host_tier_bytes"):
        CacheManagerConfig(host_tier_bytes=1.5)  # type: ignore[arg-type]


def test_a_profile_refuses_a_bad_host_link() -> None:
    raw = make_profile(CACHE_COEFFS, KAPPA_S).to_json()
    raw["host_link"] = {"h2d_bytes_s": 0}
    with pytest.raises(ProfileError, match="h2d_bytes_s"):
        Profile.from_json(raw)
    raw["host_link"] = {"h2d_bytes_s": 3e9, "source": "measured"}
    assert Profile.from_json(raw).host_link["h2d_bytes_s"] == 3e9
    assert math.isfinite(Profile.from_json(raw).host_link["h2d_bytes_s"])
