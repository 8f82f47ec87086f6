"""Reshapes under hand-off traffic, on simulated time (fake in-process ranks): the
path every completion takes (prefill with export, lease, pull) meeting a split or a
merge. A hand-off prefill that finished the drain of a reshape
once committed the switch inside ``finish`` and then looked for its worker's cache
index, which the switch had removed (``KeyError``): the worker's loop died, the
switch was never sent to the ranks, and the pool stayed ``switching`` for good.

Now the policy's hold (``policy/cache/holds.py``) keeps a draining worker from parking
until its leases end; a lease that is not pulled within ``reshape_wait_s`` ends as
moved; a reshape past ``reshape_timeout_s`` is rolled back (before its commit) or
finished (after it); a bug in one step of a worker is contained, answered once and
counted; and ``/ready``'s reason says while no worker can take requests."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path
from typing import Any

import pytest
from structlog.testing import capture_logs

from support.factories import cpu_profile, make_tokens
from support.fake_ranks import MemorySink, start_coordinator
from support.virtual_time import run_virtual
from vertumnus.config import EngineConfig
from vertumnus.config.pool import PoolConfig
from vertumnus.kv_wire import HandoffError
from vertumnus.policy.lattice import WorkerState
from vertumnus.policy.pool_config import PolicyConfig
from vertumnus.runtime.coordinator import Coordinator
from vertumnus.runtime.request_path import InternalError
from vertumnus.runtime.reshaping import ReshapeFailed
from vertumnus.runtime.serve_config import HandoffConfig, ServeConfig
from vertumnus.sim.time_model import SimSettings

SETTINGS = SimSettings(switch_s=0.02, transfer_latency_s=0.001, kv_bytes_per_token=2048)


def make_config(tmp_path: Path, **overrides: Any) -> ServeConfig:
    cfg = ServeConfig(
        pool=PoolConfig((1, 2), (1, 1)),
        engine=EngineConfig(compile="off", block_size=16, kv_blocks_per_rank=64, dtype="float32"),
        profile=cpu_profile(tmp_path),
        policy=PolicyConfig(adaptive=False, replication=False),
        handoff=HandoffConfig(lease_s=30.0, reshape_wait_s=5.0),
        request_timeout_s=600.0,
    )
    return dataclasses.replace(cfg, **overrides)


def pins(coord: Coordinator) -> int:
    return sum(1 for index in coord.indexes.values() for e in index._entries.values() if e.refcount)


async def pins_once_copied(coord: Coordinator) -> int:
    """``pins`` once the copies in flight have ended: the new workers' fetches of the
    prefixes a reshape left out of place pin their own slots while they run."""
    for _ in range(600):
        if not coord.cache.copies_in_flight:
            break
        await asyncio.sleep(0.1)
    return pins(coord)


def all_active(coord: Coordinator) -> bool:
    return all(w.state is WorkerState.ACTIVE for w in coord.lattice.workers.values())


@pytest.mark.timeout(60)
def test_a_merge_waits_for_the_leases_of_its_workers_then_switches(tmp_path: Path) -> None:
    """Two hand-off prefills run when a merge begins: each finishes with its lease
    open (the worker stays draining), a pull of one and a release of the other let
    the workers park, and the merge switches; the merged worker then serves a
    hand-off whose pull carries every token but the last."""

    async def main() -> None:
        coord, _ = await start_coordinator(make_config(tmp_path), SETTINGS)
        try:
            with capture_logs() as logs:
                first = [
                    asyncio.ensure_future(coord.prefill(make_tokens(100, seed=s), handoff=True))
                    for s in (1, 2)
                ]
                await asyncio.sleep(0.001)  # both run now
                merged = coord.begin_reshape(coord.reshape_for("merge", [0, 1]))
                a, b = await asyncio.gather(*first)
                assert a.handoff is not None and b.handoff is not None
                assert {a.worker, b.worker} == {0, 1}
                await asyncio.sleep(1.0)
                states = {w.worker_id: w.state for w in coord.lattice.workers.values()}
                assert states == {0: WorkerState.DRAINING, 1: WorkerState.DRAINING}
                assert "draining" in (coord.unready_reason() or "")
                sink, length = MemorySink(), coord.handoffs.stream_bytes(a.handoff)
                sent = await coord.handoffs.stream(a.handoff, sink)
                assert sent == len(sink.data) == length
                assert not merged.done()
                coord.handoffs.release(b.handoff.handle)
                transition = await asyncio.wait_for(merged, 5.0)
                assert transition.new_workers == [2] and coord.composition_name() == "1CP2"
                assert coord.unready_reason() is None
                after = await coord.prefill(make_tokens(70, seed=3), handoff=True)
                assert after.worker == 2 and after.handoff is not None
                assert after.handoff.num_tokens == 69
                assert await coord.handoffs.stream(after.handoff, MemorySink()) > 0
            assert coord.handoffs.view()["open"] == 0 and pins(coord) == 0
            assert not [e for e in logs if e.get("bug")], logs  # (contained bugs are marked)
            assert coord.metrics.internal_error_count == 0
        finally:
            await coord.close()

    run_virtual(main())


@pytest.mark.timeout(60)
def test_a_lease_nobody_pulls_ends_moved_after_the_reshape_wait(tmp_path: Path) -> None:
    """A lease on a draining worker that nobody pulls ends (moved) ``reshape_wait_s``
    after the reshape began; the split then completes, and a late pull is a 410."""

    async def main() -> None:
        cfg = make_config(tmp_path, pool=PoolConfig((1, 2), (2,)))
        coord, _ = await start_coordinator(cfg, SETTINGS)
        loop = asyncio.get_running_loop()
        try:
            result = await coord.prefill(make_tokens(90, seed=4), handoff=True)
            assert result.handoff is not None and pins(coord) > 0
            began = loop.time()
            transition = await asyncio.wait_for(
                coord.begin_reshape(coord.reshape_for("split", [0])), 60.0
            )
            assert loop.time() - began == pytest.approx(5.0, abs=0.1)
            assert transition.drain_s == pytest.approx(5.0, abs=0.1)
            with pytest.raises(HandoffError, match="moved") as gone:
                coord.handoffs.lookup(result.handoff.handle)
            assert gone.value.status == 410
            assert coord.handoffs.counts["moved"] == 1 and await pins_once_copied(coord) == 0
            assert coord.composition_name() == "2CP1" and all_active(coord)
        finally:
            await coord.close()

    run_virtual(main())


@pytest.mark.timeout(60)
def test_a_reshape_past_its_bound_is_rolled_back(tmp_path: Path) -> None:
    """A participant that never parks (a bug: a hold nobody will release) keeps its
    merge draining; at ``reshape_timeout_s`` the merge is rolled back: both workers
    serve again as they were, the operator's call fails with the reason, and it is
    logged and counted."""

    async def main() -> None:
        cfg = make_config(tmp_path, reshape_timeout_s=120.0)
        coord, _ = await start_coordinator(cfg, SETTINGS)
        loop = asyncio.get_running_loop()
        try:
            tokens = make_tokens(64, seed=5)
            await coord.prefill(tokens)
            index = coord.indexes[0] if 0 in coord.indexes else coord.indexes[1]
            worker = index.worker_id
            ids = [loc.block_id for loc in index.locations().values()][:1]
            coord.policy.holds.take(999, worker, index, ids, 1)  # never released
            with capture_logs() as logs:
                merge = coord.begin_reshape(coord.reshape_for("merge", [0, 1]))
                with pytest.raises(ReshapeFailed, match="rolled back"):
                    await asyncio.wait_for(merge, 600.0)
            assert loop.time() == pytest.approx(120.0, abs=0.5)
            assert coord.composition_name() == "2CP1" and all_active(coord)
            assert coord.policy.transitions == [] and not coord.policy.controller.in_flight
            events = [e for e in logs if e["event"] == "reshape_rolled_back"]
            assert len(events) == 1 and events[0]["participants"][worker]["holds"] == 1
            assert coord.metrics.overdue_reshapes.labels(how="rolled_back")._value.get() == 1
            served = await coord.prefill(make_tokens(40, seed=6))
            assert served.cp_degree == 1
            assert coord.unready_reason() is None
        finally:
            await coord.close()

    run_virtual(main())


@pytest.mark.timeout(60)
def test_a_committed_switch_past_its_bound_is_finished(tmp_path: Path) -> None:
    """A rank that never acknowledges the epoch, with ``rank_timeout_s`` longer than
    the reshape's bound: at ``reshape_timeout_s`` the switch is finished by taking
    that rank down; its worker restarts and serves."""

    async def main() -> None:
        cfg = make_config(
            tmp_path,
            engine=EngineConfig(
                compile="off",
                block_size=16,
                kv_blocks_per_rank=64,
                rank_timeout_s=1000.0,
                dtype="float32",
            ),
            reshape_timeout_s=100.0,
        )
        coord, fake = await start_coordinator(cfg, SETTINGS)
        loop = asyncio.get_running_loop()
        try:
            fake.hung_on_switch.add(1)
            with capture_logs() as logs:
                transition = await asyncio.wait_for(
                    coord.begin_reshape(coord.reshape_for("merge", [0, 1])), 600.0
                )
            assert loop.time() == pytest.approx(100.0, abs=0.5)
            failed = [e for e in logs if e["event"] == "worker_failed"]
            assert [e["ranks"] for e in failed] == [[1]] and "EpochAck" in failed[0]["reason"]
            (merged,) = transition.new_workers
            for _ in range(100):
                if coord.lattice.workers[merged].state is WorkerState.ACTIVE:
                    break
                await asyncio.sleep(0.5)
            assert coord.lattice.workers[merged].state is WorkerState.ACTIVE
            assert coord.metrics.overdue_reshapes.labels(how="forced")._value.get() == 1
            served = await coord.prefill(make_tokens(40, seed=7))
            assert served.worker == merged and served.cp_degree == 2
        finally:
            await coord.close()

    run_virtual(main())


@pytest.mark.timeout(60)
def test_a_bug_in_one_step_is_answered_once_and_the_worker_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A hand-off whose lease cannot be opened (a bug, injected): that request gets an
    internal error naming it, its hold is given back, the step is logged with its
    traceback and counted, and the same worker serves the next requests."""

    async def main() -> None:
        coord, _ = await start_coordinator(make_config(tmp_path), SETTINGS)
        try:
            calls = {"n": 0}
            real_open = coord.handoffs.open

            def failing_open(*args: Any, **kwargs: Any) -> Any:
                calls["n"] += 1
                if calls["n"] == 1:
                    raise ValueError("injected")
                return real_open(*args, **kwargs)

            monkeypatch.setattr(coord.handoffs, "open", failing_open)
            with capture_logs() as logs:
                with pytest.raises(InternalError, match="injected"):
                    await coord.prefill(make_tokens(60, seed=8), handoff=True)
                assert pins(coord) == 0 and coord.policy.open_requests == 0
                again = await coord.prefill(make_tokens(60, seed=8), handoff=True)
                assert again.handoff is not None
                coord.handoffs.release(again.handoff.handle)
            failed = [e for e in logs if e["event"] == "worker_step_failed"]
            assert len(failed) == 1 and failed[0]["exc_info"] is not None and failed[0]["bug"]
            assert coord.metrics.internal_error_count == 1
            assert pins(coord) == 0 and all_active(coord)
        finally:
            await coord.close()

    run_virtual(main())


@pytest.mark.timeout(60)
def test_a_rank_that_dies_ends_the_leases_of_its_worker(tmp_path: Path) -> None:
    """A rank of a worker holding a lease dies while the worker drains for a merge:
    the lease ends (moved), the merge goes on, and the merged worker restarts and
    serves."""

    async def main() -> None:
        coord, _ = await start_coordinator(make_config(tmp_path), SETTINGS)
        try:
            result = await coord.prefill(make_tokens(80, seed=9), handoff=True)
            assert result.handoff is not None
            merge = coord.begin_reshape(coord.reshape_for("merge", [0, 1]))
            await asyncio.sleep(0.5)
            coord.recovery.rank_down(result.worker, "killed by the test")
            transition = await asyncio.wait_for(merge, 60.0)
            assert coord.handoffs.counts["moved"] == 1 and await pins_once_copied(coord) == 0
            (merged,) = transition.new_workers
            for _ in range(100):
                if coord.lattice.workers[merged].state is WorkerState.ACTIVE:
                    break
                await asyncio.sleep(0.5)
            served = await coord.prefill(make_tokens(40, seed=10))
            assert served.worker == merged
        finally:
            await coord.close()

    run_virtual(main())


@pytest.mark.timeout(60)
def test_a_lease_opened_while_its_worker_drains_gets_the_whole_wait(tmp_path: Path) -> None:
    """A hand-off prefill that runs when a split begins opens its lease during the
    drain; nobody pulls it: it ends (moved) ``reshape_wait_s`` after it opened,
    not at the lease's own expiry (30 s), and the split completes then."""

    async def main() -> None:
        cfg = make_config(tmp_path, pool=PoolConfig((1, 2), (2,)))
        coord, _ = await start_coordinator(cfg, SETTINGS)
        loop = asyncio.get_running_loop()
        try:
            work = asyncio.ensure_future(coord.prefill(make_tokens(300, seed=11), handoff=True))
            await asyncio.sleep(0.001)  # it runs now
            split = coord.begin_reshape(coord.reshape_for("split", [0]))
            result = await work
            assert result.handoff is not None
            opened = loop.time()
            await asyncio.wait_for(split, 60.0)
            assert loop.time() - opened == pytest.approx(5.0, abs=0.1)
            assert coord.handoffs.counts["moved"] == 1 and await pins_once_copied(coord) == 0
            assert coord.composition_name() == "2CP1" and all_active(coord)
        finally:
            await coord.close()

    run_virtual(main())
