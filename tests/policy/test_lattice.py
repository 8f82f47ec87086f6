"""The buddy lattice: blocks, alignment, options, lifecycle, reachable compositions."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vertumnus.policy.geometry import (
    LatticeConfig,
    LatticeError,
    reachable_compositions,
    top_blocks,
)
from vertumnus.policy.lattice import Lattice, Reshape, WorkerState


def test_top_level_blocks() -> None:
    assert top_blocks(40, [4, 8]) == [(0, 8), (8, 8), (16, 8), (24, 8), (32, 8)]
    assert top_blocks(6, [1, 2, 4]) == [(0, 4), (4, 2)]
    assert top_blocks(12, [4, 8]) == [(0, 8), (8, 4)]
    with pytest.raises(LatticeError, match="cannot be cut"):
        top_blocks(5, [2, 4])
    with pytest.raises(LatticeError, match="consecutive powers of two"):
        LatticeConfig(16, (2, 8))


def test_layouts_are_aligned() -> None:
    config = LatticeConfig(8, (1, 2, 4))
    assert Lattice(config).layout() == [4, 4]
    lattice = Lattice(config, [1, 1, 2, 4])
    assert [(w.first_device, w.cp_degree) for w in lattice.workers.values()] == [
        (0, 1),
        (1, 1),
        (2, 2),
        (4, 4),
    ]
    with pytest.raises(LatticeError, match="not aligned"):
        Lattice(config, [1, 2, 1, 4])
    with pytest.raises(LatticeError, match="covers 6 of 8"):
        Lattice(config, [2, 4])


def test_buddies_and_options_respect_the_bounds() -> None:
    config = LatticeConfig(16, (4, 8), max_workers={4: 2})
    lattice = Lattice(config, [4, 4, 8])
    a, b, c = lattice.workers
    assert lattice.buddy(a) == b and lattice.buddy(b) == a
    assert lattice.buddy(c) is None  # 16 is not a degree
    assert lattice.merge_options() == [Reshape("merge", (a, b), 8, (0,))]
    assert lattice.split_options() == []  # a third and fourth degree-4 worker: over the bound
    unbounded = Lattice(LatticeConfig(16, (4, 8)), [4, 4, 8])
    assert unbounded.split_options() == [Reshape("split", (c,), 4, (8, 12))]


def test_lifecycle_and_epochs() -> None:
    lattice = Lattice(LatticeConfig(8, (2, 4)), [2, 2, 4])
    op = lattice.merge_options()[0]
    lattice.begin(op)
    assert [lattice.workers[s].state for s in op.sources] == [WorkerState.DRAINING] * 2
    assert [w.worker_id for w in lattice.active()] == [2]
    with pytest.raises(LatticeError, match="has not parked"):
        lattice.commit(op)
    for s in op.sources:
        lattice.park(s)
    (merged,) = lattice.commit(op)
    assert (merged.cp_degree, merged.first_device, merged.epoch) == (4, 0, 1)
    assert merged.state is WorkerState.SWITCHING and lattice.epoch == 1
    assert merged.worker_id not in [w.worker_id for w in lattice.active()]
    lattice.activate(merged.worker_id)
    assert lattice.layout() == [4, 4]
    lattice.fail(2)
    assert [w.worker_id for w in lattice.active()] == [merged.worker_id]
    with pytest.raises(LatticeError, match="not active"):
        lattice.begin(Reshape("split", (2,), 2, (4, 6)))
    lattice.restore(2)


def test_reachable_compositions() -> None:
    config = LatticeConfig(40, (4, 8))
    comps = reachable_compositions(config)
    assert comps == [{8: 5}, {4: 2, 8: 4}, {4: 4, 8: 3}, {4: 6, 8: 2}, {4: 8, 8: 1}, {4: 10}]
    bounded = LatticeConfig(40, (4, 8), min_workers={8: 1}, max_workers={4: 8})
    assert reachable_compositions(bounded) == comps[:5]  # {4: 10} has no degree-8 worker
    assert len(reachable_compositions(LatticeConfig(8, (1, 2, 4, 8)))) == 10


def reshapes(lattice: Lattice, steps: list[tuple[bool, int]]) -> Iterator[Reshape]:
    """Run each (split?, pick) step that has an option, whole; yield after each."""
    for split, pick in steps:
        options = lattice.split_options() if split else lattice.merge_options()
        if not options:
            continue
        op = options[pick % len(options)]
        lattice.begin(op)
        for s in op.sources:
            lattice.park(s)
        for w in lattice.commit(op):
            lattice.activate(w.worker_id)
        yield op


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 50)), max_size=30))
def test_any_sequence_of_reshapes_keeps_every_device_once(steps: list[tuple[bool, int]]) -> None:
    config = LatticeConfig(16, (1, 2, 4, 8))
    lattice = Lattice(config)
    for _ in reshapes(lattice, steps):
        lattice.check()
        assert sum(w.cp_degree for w in lattice.workers.values()) == 16
        assert all(w.first_device % w.cp_degree == 0 for w in lattice.workers.values())
        counts = dict(lattice.composition())
        assert counts in reachable_compositions(config)


def test_hosts_are_checked_and_known() -> None:
    # 32 devices on 4 hosts of 8: degree 16 spans two whole hosts, 4 and 8 fit in one.
    config = LatticeConfig(32, (4, 8, 16), devices_per_host=8)
    lattice = Lattice(config, [16, 8, 4, 4])
    spans = {
        w.cp_degree: (list(w.hosts(config)), w.spans_hosts(config))
        for w in lattice.workers.values()
        if w.cp_degree != 4
    }
    assert spans == {16: ([0, 1], True), 8: ([2], False)}
    assert [list(w.hosts(config)) for w in lattice.workers.values() if w.cp_degree == 4] == [
        [3],
        [3],
    ]
    with pytest.raises(LatticeError, match="could straddle two hosts"):
        LatticeConfig(24, (4, 8), devices_per_host=6)  # a degree-4 block at 4..7 would
    with pytest.raises(LatticeError, match="must be positive and divide"):
        LatticeConfig(20, (4,), devices_per_host=8)
    # No host size: one host holds everything.
    flat = LatticeConfig(16, (4, 8, 16))
    assert all(not w.spans_hosts(flat) for w in Lattice(flat).workers.values())


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 50)), max_size=30))
def test_workers_that_fit_a_host_stay_in_one(steps: list[tuple[bool, int]]) -> None:
    config = LatticeConfig(32, (2, 4, 8, 16), devices_per_host=8)
    lattice = Lattice(config)
    for _ in reshapes(lattice, steps):
        for w in lattice.workers.values():
            hosts = list(w.hosts(config))
            assert len(hosts) == max(1, w.cp_degree // 8)
            assert w.spans_hosts(config) == (w.cp_degree > 8)
