"""Simulator workloads: trace conversion, transforms, phases, shared-prefix groups,
and the simulate configuration's errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from vertumnus.config import ConfigError
from vertumnus.config.pool import parse_composition
from vertumnus.sim.config import load
from vertumnus.sim.workload import (
    LengthDistribution,
    Phase,
    SimRequest,
    WorkloadError,
    from_trace,
    phased,
    transform,
)
from vertumnus.traces import Trace, TraceRequest


def test_trace_block_ids_are_shifted_off_the_root() -> None:
    trace = Trace("t", "mooncake", 512, (TraceRequest(0.0, 1000, 1, (0, 1)),))
    assert from_trace(trace) == [SimRequest(0, 0.0, 1000, (1, 2))]
    azure = Trace("a", "azure", None, (TraceRequest(2.0, 10, 1, None),))
    assert from_trace(azure)[0].block_ids == ()


def test_rate_and_time_scales() -> None:
    reqs = [SimRequest(i, float(10 * i), 100) for i in range(4)]
    assert [r.arrival_s for r in transform(reqs, rate_scale=2.0)] == [0, 5, 10, 15]
    assert [r.arrival_s for r in transform(reqs, time_scale=3.0)] == [0, 30, 60, 90]
    kept = transform(reqs, rate_scale=2.0, time_scale=2.0, max_requests=2)
    assert [(r.request_id, r.arrival_s) for r in kept] == [(0, 0.0), (1, 10.0)]
    with pytest.raises(WorkloadError, match="positive"):
        transform(reqs, rate_scale=0)


def test_phases_set_rate_and_mix_and_draw_pools_in_order() -> None:
    pool = [SimRequest(i, 0.0, 1000 if i % 2 else 50_000, (i + 1,)) for i in range(40)]
    reqs = phased(
        [Phase(200, 5.0, 0.0), Phase(200, 1.0, 1.0)], seed=1, long_tokens=32_768, pool=pool
    )
    first = [r for r in reqs if r.phase == 0]
    second = [r for r in reqs if r.phase == 1]
    assert 850 < len(first) < 1150 and 150 < len(second) < 250  # Poisson, 5/s and 1/s
    assert all(r.input_tokens == 1000 for r in first)
    assert all(r.input_tokens == 50_000 for r in second)
    assert all(0 <= r.arrival_s < 200 for r in first) and all(
        200 <= r.arrival_s < 400 for r in second
    )
    # Short requests in pool order; a second pass gets fresh ids (no replayed reuse).
    assert [r.block_ids[0] for r in first[:3]] == [2, 4, 6]
    assert first[20].block_ids[0] == 2 + (1 << 40)
    assert phased([Phase(200, 5.0, 0.0)], 1, 32_768, pool) == phased(
        [Phase(200, 5.0, 0.0)], 1, 32_768, pool
    )


def test_shared_prefix_groups_follow_zipf() -> None:
    dist = LengthDistribution(
        short_median_tokens=9000, sigma=0.01, prefix_groups=10, prefix_tokens=4096, prefix_zipf=1.5
    )
    reqs = phased([Phase(1000, 2.0)], seed=2, long_tokens=32_768, lengths=dist)
    heads = [r.block_ids[:8] for r in reqs]
    counts = sorted((heads.count(h) for h in set(heads)), reverse=True)
    assert len(set(heads)) <= 10 and counts[0] > 3 * counts[-1]
    assert all(len(set(r.block_ids[8:]) & set(b for h in heads for b in h)) == 0 for r in reqs)


def test_config_errors_name_what_is_wrong(tmp_path: Path) -> None:
    assert parse_composition("4CP4/3CP8") == {4: 4, 8: 3}
    bad = tmp_path / "bad.toml"
    bad.write_text("[pooll]\ncomposition = '1CP4'\n")
    with pytest.raises(ConfigError, match="unknown table \\[pooll\\]; known: cache, cluster"):
        load(bad, {})
    bad.write_text("[controller]\nwindow = 30\n")
    with pytest.raises(ConfigError, match="\\[controller\\] unknown keys \\['window'\\]"):
        load(bad, {})
    with pytest.raises(ConfigError, match="no workload"):
        load(None, {})
    phases = "[workload]\nphases = [{duration_s = 1, rate = 1}]\n"
    bad.write_text("[scheduler]\nrouter = 'magic'\n" + phases)
    with pytest.raises(
        ConfigError,
        match="\\[scheduler\\] router: unknown router 'magic'; choose one of cache-first, "
        "dynamo-kv, least-load, length-threshold, llm-d, round-robin, sglang-cache-aware, "
        "vertumnus",
    ):
        load(bad, {})
    with pytest.raises(ConfigError, match="unknown preset 'magic'; choose one of vertumnus, fixed"):
        load(None, {}, raw={"workload": {"phases": [{"duration_s": 1, "rate": 1}]}}, preset="magic")
    # The spellings of earlier versions say where they went.
    bad.write_text("[policy]\nname = 'fixed'\n" + phases)
    with pytest.raises(ConfigError, match="\\[policy\\] is gone: write \\[scheduler\\] router"):
        load(bad, {})
    bad.write_text("[sim]\nblock_tokens = 512\n" + phases)
    with pytest.raises(
        ConfigError, match="\\[sim\\] block_tokens moved: write \\[engine\\] block_size"
    ):
        load(bad, {})
