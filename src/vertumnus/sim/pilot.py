"""A scenario's load against the saturation a simulated pool really reaches.

``scenarios.draw`` sets a scenario's rate against the fluid bound of its request
mix with every request's whole unbounded-cache reuse (``sim/saturation.py``): with
bounded caches, per-worker holdings and turns that arrive while their previous turn
is still queued, the pool reuses less, and the reuse families saturate well below
that bound. ``calibrated`` measures the reuse instead, twice: a pilot run of the
scenario's requests (steady, for ``pilot_s``) on a fixed pool at the bound's best
composition, first at half the bound, then at 0.9 of the saturation the first
pilot gave; each request's reuse in the mix is scaled by the token hit rate the
pilot realised over the unbounded reuse, and the fluid bound is computed again.
The scenario's rates are then scaled to keep its load against that saturation.
A pilot costs a second or two. Not owned here: the scenarios (``sim/scenarios.py``).
"""

from __future__ import annotations

import copy
import dataclasses
import itertools

from vertumnus.perfmodel import Profile
from vertumnus.policy.geometry import LatticeConfig, composition_name
from vertumnus.sim import config as sim_config
from vertumnus.sim import scenarios, sessions
from vertumnus.sim.saturation import saturation
from vertumnus.sim.simulator import Simulation

_PLACEHOLDER = {"workload": {"phases": [{"duration_s": 10.0, "rate": 10.0}]}}


def realised_reuse(scenario: scenarios.Scenario, rate: float, pilot_s: float) -> float:
    """The token hit rate of a fixed pool at ``scenario.saturation_composition`` on
    the scenario's requests, steady at ``rate``, for ``pilot_s`` (at most its
    duration), over the unbounded cache's."""
    steady = dataclasses.replace(
        scenario,
        shape="steady",
        base_rate=rate,
        second_rate=rate,
        change_s=None,
        burst_s=None,
        duration_s=min(pilot_s, scenario.duration_s),
    )
    reqs = scenarios.requests(steady)
    unbounded = sum(sessions.unbounded_reuse(reqs))
    if not reqs or unbounded == 0:
        return 1.0
    cfg = sim_config.load(
        None,
        {"pool": {"composition": scenario.saturation_composition}},
        raw=copy.deepcopy(_PLACEHOLDER),
        preset="fixed",
    )
    result = Simulation(cfg.settings, cfg.profile, cfg.spec, cfg.policy, reqs).run()
    cached = sum(r.cached_tokens for r in result.records)
    return min(1.0, cached / unbounded)


def calibrated(
    scenario: scenarios.Scenario,
    profile: Profile | None = None,
    lattice: LatticeConfig | None = None,
    pilot_s: float = 90.0,
    known: tuple[float, str] | None = None,
) -> scenarios.Scenario:
    """``scenario`` with its saturation from the pilots (module docstring) and its
    rates scaled to keep its load. ``known``: the (saturation, composition) pilots
    found before for this scenario (they are deterministic), to skip them."""
    if known is not None:
        return rescaled(scenario, *known)
    lattice = lattice or sim_config.DEFAULT_POOL.lattice
    profile = profile or Profile.load(sim_config.DEFAULT_PROFILE)
    sample = list(
        itertools.islice(
            sessions.mix_sample(scenario.seed, scenario.lengths, scenario.reuse),
            scenarios.MIX_REQUESTS,
        )
    )
    rate, best = scenario.saturation_rate, scenario.saturation_composition
    probe = 0.5 * rate
    for _ in range(2):
        share = realised_reuse(dataclasses.replace(scenario, saturation_composition=best),
                               probe, pilot_s)  # fmt: skip
        mix = [(n, int(p * share)) for _, n, p in sample]
        found, comp = saturation(mix, profile, lattice)
        rate, best = found, composition_name(comp)
        probe = 0.9 * rate
    return rescaled(scenario, rate, best)


def rescaled(scenario: scenarios.Scenario, rate: float, best: str) -> scenarios.Scenario:
    """The scenario against saturation ``rate`` (at composition ``best``), its load kept."""
    factor = rate / scenario.saturation_rate
    return dataclasses.replace(
        scenario,
        base_rate=scenario.base_rate * factor,
        second_rate=scenario.second_rate * factor,
        saturation_rate=rate,
        saturation_composition=best,
    )
