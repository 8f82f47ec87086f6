"""``[pool] composition = "auto"``: the first composition, from what a server has.

Both ``serve`` and ``simulate`` resolve it here, when they read their configuration,
from the first of three sources (``[pool]`` keys, ``config/pool.py``):

    start_workload  a representative workload the operator gives: a trace file
                    (Mooncake JSONL or Azure CSV: another trace, or yesterday's),
                    its arrivals times ``start_rate_scale``
    state_file      the composition the previous run of this pool left there, if
                    its lattice (ranks, degrees, bounds) is this pool's; a file that
                    cannot be read or does not match is passed over with a warning
    start_rate      the built-in length mix (a sample of the Mooncake conversation
                    trace, with its unbounded-cache reuse), Poisson at this rate

A workload's first ``start_span_s`` seconds are replayed over every composition of
the lattice (``policy/start.py``, ``control.candidates.best_start``) and the fastest
is the start. No run looks at the requests it will serve: the simulator's own
workload is never a source.

The state file (JSON: ``composition``, ``layout``, ``degrees``, ``ranks``,
``written_at``) is written atomically (a temporary file, then ``os.replace``):
``serve`` writes it on every completed reshape and at shutdown, ``simulate`` at the
end of a run. Relative paths are from the working directory.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import orjson

from vertumnus.capacity import LengthMix
from vertumnus.config.pool import NO_START_SOURCE, PoolConfig
from vertumnus.config.tables import ConfigError
from vertumnus.perfmodel import Profile
from vertumnus.policy.control.composition import layout_for
from vertumnus.policy.control.forecast import ArrivalSample
from vertumnus.policy.geometry import LatticeConfig, composition_name
from vertumnus.policy.pool_config import PolicyConfig
from vertumnus.policy.start import PoolState, mix_samples, replay_start, trace_samples
from vertumnus.traces import TraceError, load_trace

START_SEED = 0  # the built-in mix's arrivals and lengths
SOURCES = ("start_workload", "state_file", "builtin_mix")


@dataclasses.dataclass(frozen=True)
class StartDecision:
    """How a pool's first composition was chosen."""

    source: str  # one of SOURCES
    origin: str  # the file it came from, or the built-in mix and its rate
    layout: tuple[int, ...]
    predicted_s: dict[str, float]  # composition -> predicted mean TTFT ({}: no replay)
    warnings: tuple[str, ...] = ()  # the sources passed over, and why

    @property
    def composition(self) -> str:
        counts: dict[int, int] = {}
        for c in self.layout:
            counts[c] = counts.get(c, 0) + 1
        return composition_name(counts)

    def to_json(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "origin": self.origin,
            "composition": self.composition,
            "predicted_s": dict(self.predicted_s),
        }


def resolve_start(
    pool: PoolConfig, profile: Profile, policy: PolicyConfig
) -> tuple[PoolConfig, StartDecision | None]:
    """``pool`` with the layout its start sources give (None: its composition was
    given, and it is returned as it is). ConfigError when none gives one."""
    start = pool.start
    if not start.auto:
        return pool, None
    lattice = pool.lattice
    missing = sorted(set(lattice.degrees) - set(profile.coeffs))
    if missing:
        raise ConfigError(f"the profile has no degrees {missing} to choose a start from")
    warnings: list[str] = []
    if start.start_workload is not None:
        samples = workload_samples(start.start_workload, start.start_rate_scale, start.start_span_s)
        decision = _replayed(
            "start_workload", start.start_workload, lattice, profile, policy, samples
        )
    else:
        state, why = (None, None)
        if start.state_file is not None:
            state, why = read_state(start.state_file, lattice)
        if state is not None:
            assert start.state_file is not None
            decision = StartDecision("state_file", start.state_file, state.layout, {})
        elif start.start_rate is not None:
            if why is not None:
                warnings.append(why)
            mix = LengthMix.builtin()
            samples = mix_samples(mix.requests, start.start_rate, start.start_span_s, START_SEED)
            origin = f"{mix.name} at {start.start_rate:g} requests/s"
            decision = _replayed("builtin_mix", origin, lattice, profile, policy, samples)
        else:
            found = why or f"{start.state_file} does not exist yet"
            raise ConfigError(f"{NO_START_SOURCE}; the state file gives none: {found}")
    decision = dataclasses.replace(decision, warnings=tuple(warnings))
    return dataclasses.replace(pool, layout=decision.layout), decision


def _replayed(
    source: str,
    origin: str,
    lattice: LatticeConfig,
    profile: Profile,
    policy: PolicyConfig,
    samples: Sequence[ArrivalSample],
) -> StartDecision:
    if not samples:
        raise ConfigError(f"[pool] {origin}: no request in the first start_span_s seconds")
    choice = replay_start(lattice, profile, policy, samples)
    layout = tuple(layout_for(lattice, choice.composition))
    return StartDecision(source, origin, layout, dict(choice.predicted_s))


def workload_samples(path: str, rate_scale: float, span_s: float) -> list[ArrivalSample]:
    """The first ``span_s`` seconds of the trace at ``path`` (its arrivals divided by
    ``rate_scale``), each request's floor the prefix earlier ones had."""
    try:
        trace = load_trace(path)
    except TraceError as exc:
        raise ConfigError(f"[pool] start_workload: {exc}") from exc
    cached = trace.cached_tokens_unbounded()
    requests = (
        (r.arrival_s, r.input_tokens, n) for r, n in zip(trace.requests, cached, strict=True)
    )
    return trace_samples(requests, rate_scale, span_s)


def read_state(path: str, lattice: LatticeConfig) -> tuple[PoolState | None, str | None]:
    """(the state at ``path`` if it can start a pool of ``lattice``, else None; why
    not, None when the file does not exist)."""
    try:
        text = Path(path).read_bytes()
    except FileNotFoundError:
        return None, None
    except OSError as exc:
        return None, f"the state file {path} cannot be read ({exc})"
    try:
        state = PoolState.from_json(orjson.loads(text))
    except ValueError as exc:  # (orjson's decode error is one)
        return None, f"the state file {path} is not a pool state ({exc})"
    why = state.mismatch(lattice)
    if why is not None:
        return None, f"the state file {path} is not this pool's: {why}"
    return state, None


def write_state(path: str, lattice: LatticeConfig, layout: Sequence[int]) -> PoolState:
    """Keep ``layout`` at ``path`` for the next start: written beside it, then
    renamed over it (a reader sees the old file or the new one, never a part)."""
    now = dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
    state = PoolState.of(lattice, layout, now)
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    temporary = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    with temporary.open("wb") as f:
        f.write(orjson.dumps(state.to_json(), option=orjson.OPT_INDENT_2))
        f.flush()
        os.fsync(f.fileno())
    os.replace(temporary, target)
    return state
