"""The discrete-event simulator: the pool's policy stack, simulated workers and time.

The policy is ``PoolPolicy``, the very stack the coordinator drives (lattice,
router, controller, reshapes, prefix-cache manager, per-worker cache indexes, KV
ledger). The simulator adds only an event heap and a time model
(``sim/time_model.py``): a worker runs its queue FIFO, one prefill at a time, for
as long as the time model says; a copy or a switch holds the policy's copy lanes for
its time. The events (``sim/events.py``) are ordered by (time, rank, sequence
number), so a run is deterministic for a seed; ``Simulation.run`` pops them and
does what the policy's answers ask, recording what happens (``sim/results.py``).

A request that finds no candidate (every worker draining) waits in the policy and
is placed when a reshape's new workers serve. A run pauses Python's cyclic
collector (``collector_paused``: at 1,024 GPUs it found nothing and cost a quarter
of the wall time).
"""

from __future__ import annotations

import copy
import dataclasses
import gc
import heapq
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager

from vertumnus.perfmodel import COEFF_NAMES, Profile
from vertumnus.policy.placement.queues import PlacementRequest
from vertumnus.policy.pool_config import PolicyConfig, PolicyError, PoolSpec
from vertumnus.policy.pool_policy import PoolPolicy
from vertumnus.policy.pool_results import Actions, Switch
from vertumnus.policy.timeline import Timeline, trailing_window_s, worker_rows
from vertumnus.sim.events import (
    PERIODIC,
    Arrival,
    CopyLanded,
    Event,
    HandoffEnd,
    PrefillEnd,
    ReservationsDue,
    SampleDue,
    ScanDue,
    SwitchAcked,
    WindowDue,
)
from vertumnus.sim.results import RequestRecord, ReshapeRecord, SimResult, WindowRow
from vertumnus.sim.time_model import SimSettings, SimulationError, TimeModel
from vertumnus.sim.workload import SimRequest
from vertumnus.stats import progress

__all__ = ["Simulation"]


SAMPLES = 500  # the timeline's samples over the arrivals, unless [sim] sample_s says


class Simulation:
    def __init__(
        self,
        settings: SimSettings,
        profile: Profile,
        pool: PoolSpec,
        policy: PolicyConfig,
        requests: Sequence[SimRequest],
        progress: Callable[[int, int, float], None] | None = None,
    ) -> None:
        if settings.profile_bias:
            profile = biased(profile, settings.profile_bias)
        # The host tier's geometry, as the copy model's: the KV's bytes, the host size
        # and the network between hosts.
        pool = dataclasses.replace(
            pool,
            block_bytes=pool.block_bytes or settings.kv_bytes_per_token * pool.block_tokens,
            devices_per_host=pool.devices_per_host
            or pool.lattice.devices_per_host
            or settings.devices_per_host,
            net_bytes_s=pool.net_bytes_s or settings.inter_host_bytes_s,
        )
        try:
            self.policy = PoolPolicy.build(profile, pool, policy)
        except PolicyError as exc:
            raise SimulationError(str(exc)) from exc
        self.s = settings
        self.config = policy
        self.time = TimeModel(settings, pool.block_tokens)
        self.requests = list(requests)
        self.progress = progress
        degrees = list(pool.lattice.degrees)
        self.records = [
            RequestRecord(r.request_id, r.arrival_s, r.input_tokens, r.phase) for r in self.requests
        ]
        for rec in self.records:
            rec.tau_s = settings.slo.tau_s(rec.input_tokens, profile.predict, degrees)
        self._events: list[tuple[float, int, int, Event]] = []
        self._seq = 0
        self._window_arrivals = 0
        self._window_start_s = 0.0  # the first window starts with the run
        self.windows: list[WindowRow] = []
        self.reshapes: list[ReshapeRecord] = []
        self._reshape_of: dict[int, ReshapeRecord] = {}
        self._idle_windows = 0
        self.copies = self.blocks_copied = self.reclaims = 0
        self._done = 0
        self._compute_s: dict[int, float] = {}  # worker -> its running prefill's compute
        last = max((r.arrival_s for r in self.requests), default=0.0)
        sample_s = settings.sample_s or max(last, 1.0) / SAMPLES
        window_s = trailing_window_s(policy.controller.period_s, sample_s)
        self.timeline = Timeline(sample_s, None, None, window_s=window_s)

    def _push(self, t: float, event: Event) -> None:
        self._seq += 1
        heapq.heappush(self._events, (t, event.rank, self._seq, event))

    def run(self) -> SimResult:
        with collector_paused():
            return self._run()

    def _run(self) -> SimResult:
        wall = time.perf_counter()
        for r in self.requests:
            self._push(r.arrival_s, Arrival(r.request_id))
        h = self.config.controller.period_s
        self._push(h - self.s.window_phase_s % h, WindowDue())
        if self.config.replication:
            self._push(self.config.scan_interval_s, ScanDue())
        self._push(self.timeline.next_s, SampleDue())
        now = 0.0
        total = len(self.requests)
        step = max(1, total // 100)
        while self._events and self._done < total:
            now, _, _, event = heapq.heappop(self._events)
            match event:
                case PrefillEnd(worker_id):
                    self._prefill_end(worker_id, now)
                    if self.progress is not None and self._done % step == 0:
                        self.progress(self._done, total, now)
                case Arrival(request_id):
                    self._window_arrivals += 1
                    self.timeline.arrived(now)
                    r = self.requests[request_id]
                    request = PlacementRequest(request_id, r.input_tokens, r.block_ids)
                    self._apply(self.policy.arrive(request, now), now)
                case CopyLanded(job):
                    self._apply(self.policy.copy_done(job, True, now), now)
                case SwitchAcked(switch):
                    self._acknowledge(switch, now)
                case WindowDue():
                    self._window(now)
                case ScanDue():
                    outcome = self.policy.scan(now)
                    self.reclaims += outcome.reclaimed
                    self._apply(outcome.actions, now)
                    self._push(now + self.config.scan_interval_s, ScanDue())
                case ReservationsDue():
                    self.policy.expire(now)
                case HandoffEnd(hold):
                    self._apply(self.policy.release_hold(hold, now), now)
                case SampleDue():
                    self.timeline.sample(now, self.policy)
                    self._push(self.timeline.next_s, SampleDue())
        if self._done < total:
            raise SimulationError(f"the run stalled: {total - self._done} requests never finished")
        self._window(now, final=True)
        self.timeline.sample(now, self.policy)
        if self.progress is not None:
            self.progress(total, total, now)
        return SimResult(
            records=self.records,
            windows=self.windows,
            reshapes=self.reshapes,
            decisions=self.policy.controller.history,
            copies=self.copies,
            blocks_copied=self.blocks_copied,
            reclaims=self.reclaims,
            cache_audit=self.policy.cache.audit.summary(),
            scans=list(self.policy.cache.audit.scans),
            wall_s=time.perf_counter() - wall,
            sim_end_s=now,
            devices=self.policy.lattice.config.num_devices,
            timeline=self.timeline,
            workers=worker_rows(self.policy, now),
            host_tier=self.policy.tiers.summary(),
        )

    # -- what the policy asks for ------------------------------------------------------

    def _apply(self, actions: Actions, now: float) -> None:
        if actions.refused:
            raise SimulationError(
                f"requests {actions.refused[:5]} found no worker and none is coming back"
            )
        for placement in actions.placed:
            self._try_start(placement.worker_id, now)
        for worker_id in actions.woken:
            self._try_start(worker_id, now)
        for _, installed in actions.copies_ended:
            if installed:
                self.copies += 1
                self.blocks_copied += installed
        for transition in actions.activated:
            record = self._reshape_of.pop(id(transition))
            record.drain_s, record.switch_s = transition.drain_s, transition.switch_s
        for job in actions.copies:
            self._push(now + self.time.copy_s(job.moves), CopyLanded(job))
        if actions.switch is not None:
            self._push(now + self.time.switch_s, SwitchAcked(actions.switch))
            if actions.switch.expire_at_s is not None:
                self._push(actions.switch.expire_at_s, ReservationsDue())

    def _try_start(self, worker_id: int, now: float) -> None:
        started = self.policy.start(worker_id, now)
        if started is None:
            return
        rec = self.records[started.request_id]
        rec.cached_tokens, rec.worker, rec.cp_degree, rec.start_s = (
            started.cached_tokens,
            worker_id,
            started.cp_degree,
            now,
        )
        rec.tier_tokens = started.loaded_tokens
        seconds = self.time.prefill_s(started.exec_s, started.cp_degree)
        # The ranks' own compute: the busy time less the serving path's share.
        compute_s = seconds * started.exec_s / (started.exec_s + self.s.dispatch_s)
        self._compute_s[worker_id] = compute_s
        self._push(now + seconds, PrefillEnd(worker_id))

    def _prefill_end(self, worker_id: int, now: float) -> None:
        running = self.policy.running(worker_id)
        assert running is not None, "a prefill ended on an idle worker"
        rec = self.records[running.request_id]
        pull_s = self.time.handoff_s(rec.input_tokens)
        compute_s = self._compute_s.pop(worker_id)
        finished = self.policy.finish(worker_id, now, compute_s=compute_s, hold=pull_s is not None)
        if finished.hold is not None and pull_s is not None:
            self._push(now + pull_s, HandoffEnd(finished.hold))
        rec.end_s = now + self.time.ext_s(rec.input_tokens)  # the first token reaches the client
        ttft_s = rec.end_s - rec.arrival_s
        self.timeline.finished(now, ttft_s, rec.tau_s, rec.input_tokens, rec.cached_tokens)
        self._done += 1
        self._apply(finished.actions, now)
        self._try_start(worker_id, now)

    def _acknowledge(self, switch: Switch, now: float) -> None:
        for worker_id, devices in switch.workers:
            for cp_rank in range(len(devices)):
                self._apply(
                    self.policy.acknowledge(switch.transition, worker_id, cp_rank, now), now
                )

    def _window(self, now: float, final: bool = False) -> None:
        """A window ends (``final``: the run ended inside it; its row is recorded but
        nothing is decided)."""
        h = self.config.controller.period_s
        outcome = self.policy.end_window(now, final)
        decision = outcome.decision
        rule = decision.rule
        if final:
            rule = "end"
        elif not self.config.adaptive and decision.ops:
            rule = "fixed"  # a fixed composition: noted, not run
        self.timeline.decided(now, decision.inputs)
        for transition in outcome.begun:
            self.timeline.reshaped(now, transition.op.kind, decision.to_json())
            record = ReshapeRecord(transition.op.kind, now, None, None)
            self.reshapes.append(record)
            self._reshape_of[id(transition)] = record
        self._apply(outcome.actions, now)
        self.windows.append(
            WindowRow(
                decision.window,
                self._window_start_s,
                now,
                self._window_arrivals,
                decision.demand_s,
                decision.capacity_s,
                self.policy.composition_name(),
                decision.long_fraction,
                rule,
            )
        )
        self._window_start_s = now
        if final:
            return
        self._idle_windows = self._idle_windows + 1 if self._window_arrivals == 0 else 0
        if self._idle_windows > 10_000 and not any(
            not isinstance(e, PERIODIC) for _, _, _, e in self._events
        ):
            raise SimulationError(f"the run stalled at t = {now:.0f} s with requests waiting")
        self._window_arrivals = 0
        self._push(now + h, WindowDue())


@contextmanager
def collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off for the block, as it was after it. The
    policy's structures free by reference counting: a run of 1,024 GPUs left no
    cycle for any of its 2,048 collections to find in a minute of simulated time,
    and they took 15 % of its wall time (full ones rescan the trie's millions of
    nodes). Whatever cycles a run leaves are collected after it."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def biased(profile: Profile, bias: Mapping[int, float]) -> Profile:
    """The profile with degree C's coefficients times ``bias[C]`` (E scales with them;
    the attention mix stays the model's)."""
    coeffs = {
        c: dataclasses.replace(k_, **{k: getattr(k_, k) * bias.get(c, 1.0) for k in COEFF_NAMES})
        for c, k_ in profile.coeffs.items()
    }
    out = copy.copy(profile)
    out.coeffs = coeffs
    return out


def terminal_progress(done: int, total: int, sim_s: float) -> None:
    progress(done, total, f"requests, t = {sim_s:,.0f} s")
