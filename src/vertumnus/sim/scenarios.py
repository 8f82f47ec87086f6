"""Randomized scenarios for the robustness suite: drawn per seed, generated as requests.

``draw(seed)`` gives a ``Scenario``: everything one seed decides (duration, the
shape of the rate, the reuse family and its knobs, the length mix, the load and
three start compositions); ``requests(scenario)`` turns it into ``SimRequest``s.
Both are deterministic for a seed. ``TUNE_SEEDS`` and ``REPORT_SEEDS`` are apart:
tune on the one, report the other.

Arrivals. Sessions (one request, a conversation or an agent's run) start as a
non-homogeneous Poisson process (thinning) of rate lambda(t) / m, lambda(t) the
shape's request rate and m the mean requests per session, from ``LEAD_S`` before
0; a session's later requests follow its own gaps; only those in [0,
``duration_s``) are kept. Shapes::

    steady   lambda = r0
    step     r0 until change_s (20-80 % in), then r1 = r0 times or over 1.5-4
    ramp     from r0 at 0 linearly to r1 at the end (r1/r0 in 1.5-4, up or down)
    burst    r0, and r1 = 2-4 x r0 from change_s for burst_s (1-3 min)

with r0, r1 set so that lambda's peak over the run is ``load`` (0.2-1.1) x the
saturation.

Reuse families (``Reuse``): ``none``; ``system`` (a few hot prompts of 1-16K
tokens with Zipf popularity begin a share of the requests); ``conversation``
(turn k's prompt is turn k-1's, plus its answer, plus a new user message; think
times of seconds to a minute); ``agent`` (a tool prompt per agent type, then a
context that grows by short steps, gaps of 1 to a few seconds: a step's answer
comes before the next step). The length mix
(``LengthMix``) draws the new content of a session's first request: log-normal
with a median of 1-8K tokens, or with probability ``long_share`` (0-25 %)
log-uniform over 32K-128K; a session ends before a request past 128K.

Block ids name whole prefixes: a request's block j has the id of block j of an
earlier request only if both hold the same tokens up to the end of that block (a
hot prompt's full blocks, the previous turn's full blocks); every other block gets
a fresh random id. So the reusable prefix of a request with an unbounded cache is
its run of leading blocks already seen (``unbounded_reuse``), as a prefix-chain
hash would give.

The load is against the saturation of the best composition for the family's
request mix (a sample of ``MIX_REQUESTS``, each with its unbounded-cache reuse):
the fluid bound of ``sim/saturation.py``, an upper bound on what the simulated pool
serves, so that past load 1 every composition overloads.

Pure Python. Not owned here: the fluid bound (``sim/saturation.py``), running the
simulations and the report (``tools/experiments/robustness.py``).
"""

from __future__ import annotations

import bisect
import itertools
import math
import random
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

from vertumnus.blocks import max_reuse_blocks
from vertumnus.perfmodel import Profile
from vertumnus.policy.lattice import LatticeConfig, composition_name, reachable_compositions
from vertumnus.sim.config import DEFAULT_POOL, DEFAULT_PROFILE
from vertumnus.sim.saturation import saturation
from vertumnus.sim.workload import SimRequest

BLOCK_TOKENS = 512  # the traces' and the default engine's block
LONG_TOKENS = 32_768  # a request over this is long (the controller's default)
MAX_TOKENS = 131_072
SHAPES = ("steady", "step", "ramp", "burst")
FAMILIES = ("none", "system", "conversation", "agent")
TUNE_SEEDS = tuple(range(16))
REPORT_SEEDS = tuple(range(100, 160))
MIX_REQUESTS = 4_000  # the sample the saturation is computed on
LEAD_S = 180.0  # sessions start this long before 0, so that the run starts in steady state


@dataclass(frozen=True)
class LengthMix:
    short_median_tokens: int  # of the new content of a session's first request
    short_sigma: float
    long_share: float  # of sessions starting with 32K-128K tokens of their own


@dataclass(frozen=True)
class NoReuse:
    family: str = "none"


@dataclass(frozen=True)
class SystemPrompts:
    prompt_tokens: tuple[int, ...]  # each hot prompt's length, most popular first
    zipf: float  # popularity of prompt k ~ 1 / (k + 1) ** zipf
    prompted_share: float  # of requests that start with one
    family: str = "system"


@dataclass(frozen=True)
class Conversations:
    mean_turns: float  # geometric
    answer_tokens: int  # the previous answer, in the next prompt
    message_median_tokens: int  # a new user message (log-normal, sigma 0.7)
    think_max_s: float  # think time uniform in [2 s, think_max_s]
    family: str = "conversation"


@dataclass(frozen=True)
class Agents:
    tool_tokens: tuple[int, ...]  # each agent type's tool/system prompt
    zipf: float
    mean_steps: float  # requests per run, geometric
    step_median_tokens: int  # what a step appends: action and observation
    gap_max_s: float  # gaps uniform in [1 s, gap_max_s] (the step's answer comes first)
    family: str = "agent"


Reuse = NoReuse | SystemPrompts | Conversations | Agents


@dataclass(frozen=True)
class Scenario:
    seed: int
    duration_s: float
    shape: str
    base_rate: float  # requests/s: r0 (steady: throughout; burst: outside the burst)
    second_rate: float  # r1: step, after change_s; ramp, at the end; burst, in it
    change_s: float | None  # step: when the rate changes; burst: when it starts
    burst_s: float | None  # burst: how long
    load: float  # peak rate over the saturation
    saturation_rate: float  # requests/s, the fluid bound of the best composition
    saturation_composition: str
    session_requests: float  # mean requests per session (of the saturation's sample)
    lengths: LengthMix
    reuse: Reuse
    starts: tuple[str, str, str]  # the default start, then two others

    @property
    def family(self) -> str:
        return self.reuse.family

    @property
    def mean_rate(self) -> float:
        """Requests/s over the run, on average."""
        r0, r1, d = self.base_rate, self.second_rate, self.duration_s
        high_s = {"step": d - (self.change_s or 0.0), "ramp": d / 2, "burst": self.burst_s}
        return r0 + (r1 - r0) * (high_s.get(self.shape) or 0.0) / d

    @property
    def peak_rate(self) -> float:
        return max(self.base_rate, self.second_rate)

    def rate_at(self, t_s: float) -> float:
        r0, r1 = self.base_rate, self.second_rate
        if self.shape == "step":
            return r0 if t_s < (self.change_s or 0.0) else r1
        if self.shape == "ramp":
            return r0 + (r1 - r0) * min(1.0, max(0.0, t_s) / self.duration_s)
        if self.shape == "burst":
            start, length = self.change_s or 0.0, self.burst_s or 0.0
            return r1 if start <= t_s < start + length else r0
        return r0

    def phase_at(self, t_s: float) -> int:
        """0 before the step or burst (and for steady and ramp), 1 after the step or
        in the burst, 2 after the burst."""
        if self.change_s is None or t_s < self.change_s:
            return 0
        if self.burst_s is not None and t_s >= self.change_s + self.burst_s:
            return 2
        return 1

    def describe(self) -> dict[str, Any]:
        """Every parameter, as plain JSON values (the family's knobs under ``reuse``)."""
        return asdict(self)


def _log_uniform(rng: random.Random, lo: float, hi: float) -> float:
    return math.exp(rng.uniform(math.log(lo), math.log(hi)))


def _draw_reuse(family: str, rng: random.Random) -> Reuse:
    if family == "system":
        prompts = tuple(int(_log_uniform(rng, 1024, 16384)) for _ in range(rng.randint(1, 8)))
        return SystemPrompts(prompts, rng.uniform(0.5, 1.5), rng.uniform(0.1, 1.0))
    if family == "conversation":
        return Conversations(
            rng.uniform(1.0, 4.0),
            rng.randint(100, 800),
            int(_log_uniform(rng, 100, 2000)),
            rng.uniform(10.0, 60.0),
        )
    if family == "agent":
        tools = tuple(int(_log_uniform(rng, 1024, 8192)) for _ in range(rng.randint(1, 6)))
        return Agents(
            tools,
            rng.uniform(0.0, 1.2),
            rng.uniform(1.0, 3.0),
            int(_log_uniform(rng, 100, 1500)),
            rng.uniform(2.0, 6.0),
        )
    return NoReuse()


def draw(
    seed: int, profile: Profile | None = None, lattice: LatticeConfig | None = None
) -> Scenario:
    """The scenario of ``seed`` on ``lattice`` (default: 40 GPUs at {4, 8}), its load
    measured against ``profile``'s saturation (default: the shipped profile)."""
    lattice = lattice or DEFAULT_POOL.lattice
    profile = profile or Profile.load(DEFAULT_PROFILE)
    rng = random.Random(f"scenario:{seed}")
    duration_s = rng.uniform(120.0, 1200.0)
    shape = rng.choice(SHAPES)
    lengths = LengthMix(
        int(_log_uniform(rng, 1000, 8000)), rng.uniform(0.4, 1.0), rng.uniform(0.0, 0.25)
    )
    reuse = _draw_reuse(rng.choice(FAMILIES), rng)
    load = rng.uniform(0.2, 1.1)
    default = composition_name(DEFAULT_POOL.composition)
    others = [n for c in reachable_compositions(lattice) if (n := composition_name(c)) != default]
    first, second = rng.sample(others, 2)
    ratio = rng.uniform(1.5, 4.0) if shape != "burst" else rng.uniform(2.0, 4.0)
    if shape in ("step", "ramp") and rng.random() < 0.5:
        ratio = 1 / ratio
    change_s = burst_s = None
    if shape == "step":
        change_s = rng.uniform(0.2, 0.8) * duration_s
    elif shape == "burst":
        burst_s = min(rng.uniform(60.0, 180.0), 0.5 * duration_s)
        change_s = rng.uniform(0.1 * duration_s, 0.9 * duration_s - burst_s)
    sample = list(itertools.islice(mix_sample(seed, lengths, reuse), MIX_REQUESTS))
    sessions = sum(first_of_session for first_of_session, _, _ in sample)
    mix = [(n, p) for _, n, p in sample]
    rate, best = saturation(mix, profile, lattice)
    # r0 so that lambda's peak over the run is load x saturation: from light load
    # to 1.1 times the saturation at the busiest, never beyond.
    if shape in ("step", "ramp", "burst"):
        peak_factor = max(1.0, ratio)
    else:
        peak_factor, ratio = 1.0, 1.0
    base = load * rate / peak_factor
    return Scenario(
        seed=seed,
        duration_s=duration_s,
        shape=shape,
        base_rate=base,
        second_rate=base * ratio,
        change_s=change_s,
        burst_s=burst_s,
        load=load,
        saturation_rate=rate,
        saturation_composition=composition_name(best),
        session_requests=len(sample) / sessions,
        lengths=lengths,
        reuse=reuse,
        starts=(default, first, second),
    )


def scaled(scenario: Scenario, factor: float) -> Scenario:
    """The scenario on a timeline ``factor`` times as long (rates, gaps and the
    load kept): for quick runs."""
    if not factor > 0:
        raise ValueError(f"the duration scale must be > 0, got {factor}")
    return replace(
        scenario,
        duration_s=scenario.duration_s * factor,
        change_s=None if scenario.change_s is None else scenario.change_s * factor,
        burst_s=None if scenario.burst_s is None else scenario.burst_s * factor,
    )


# -- sessions --------------------------------------------------------------------------


class _Context:
    """A prompt that grows: its full blocks' ids and its length in tokens."""

    __slots__ = ("blocks", "rng", "tokens")

    def __init__(self, rng: random.Random, shared: Sequence[int] = (), tokens: int = 0) -> None:
        self.rng, self.blocks, self.tokens = rng, list(shared), tokens

    def extend(self, tokens: int) -> None:
        """Append ``tokens`` new tokens: the blocks they complete get fresh ids (the
        one that was partial holds new content now)."""
        self.tokens += tokens
        self.blocks += [
            self.rng.getrandbits(62) | 1 << 62
            for _ in range(self.tokens // BLOCK_TOKENS - len(self.blocks))
        ]


def _new_content(rng: random.Random, lengths: LengthMix) -> int:
    if rng.random() < lengths.long_share:
        return int(_log_uniform(rng, LONG_TOKENS + 1, MAX_TOKENS))
    median = lengths.short_median_tokens
    return int(min(LONG_TOKENS, max(64, rng.lognormvariate(math.log(median), lengths.short_sigma))))


def _shared_prompts(seed: int, lengths: Sequence[int]) -> list[tuple[int, list[int]]]:
    rng = random.Random(f"prompts:{seed}")
    return [(n, [rng.getrandbits(62) | 1 << 62 for _ in range(n // BLOCK_TOKENS)]) for n in lengths]


def _pick(rng: random.Random, cum_weights: Sequence[float]) -> int:
    return bisect.bisect_left(cum_weights, rng.random() * cum_weights[-1])


def _zipf(count: int, exponent: float) -> list[float]:
    return list(itertools.accumulate(1.0 / (k + 1) ** exponent for k in range(count)))


Session = list[tuple[float, int, tuple[int, ...]]]  # (seconds after its start, tokens, ids)


def _sessions(seed: int, lengths: LengthMix, reuse: Reuse, rng: random.Random) -> Iterator[Session]:
    """Sessions of the family, one after another, their requests' times relative."""
    prompts: list[tuple[int, list[int]]] = []
    popularity: list[float] = []
    if isinstance(reuse, SystemPrompts | Agents):
        sizes = reuse.prompt_tokens if isinstance(reuse, SystemPrompts) else reuse.tool_tokens
        prompts, popularity = _shared_prompts(seed, sizes), _zipf(len(sizes), reuse.zipf)
    while True:
        out: Session = []
        context = _Context(rng)
        if isinstance(reuse, Agents) or (
            isinstance(reuse, SystemPrompts) and rng.random() < reuse.prompted_share
        ):
            tokens, shared = prompts[_pick(rng, popularity)]
            context = _Context(rng, shared, tokens)
        context.extend(_new_content(rng, lengths))
        t_s = 0.0
        while context.tokens <= MAX_TOKENS:
            out.append((t_s, context.tokens, tuple(context.blocks)))
            if isinstance(reuse, Conversations) and rng.random() < 1 - 1 / reuse.mean_turns:
                message = rng.lognormvariate(math.log(reuse.message_median_tokens), 0.7)
                context.extend(reuse.answer_tokens + max(1, int(message)))
                t_s += rng.uniform(2.0, reuse.think_max_s)
            elif isinstance(reuse, Agents) and rng.random() < 1 - 1 / reuse.mean_steps:
                step = rng.lognormvariate(math.log(reuse.step_median_tokens), 0.7)
                context.extend(max(1, int(step)))
                t_s += rng.uniform(1.0, reuse.gap_max_s)
            else:
                break
        if out:
            yield out


def mix_sample(seed: int, lengths: LengthMix, reuse: Reuse) -> Iterator[tuple[bool, int, int]]:
    """(first of its session, input tokens, unbounded-cache reuse in tokens) of the
    family's requests, session after session (their own stream of draws)."""
    seen: set[int] = set()
    for session in _sessions(seed, lengths, reuse, random.Random(f"mix:{seed}")):
        for k, (_, tokens, ids) in enumerate(session):
            yield k == 0, tokens, _reused_blocks(tokens, ids, seen) * BLOCK_TOKENS


def _reused_blocks(tokens: int, ids: Sequence[int], seen: set[int]) -> int:
    limit = min(len(ids), max_reuse_blocks(tokens, BLOCK_TOKENS))
    reused = 0
    while reused < limit and ids[reused] in seen:
        reused += 1
    seen.update(ids)
    return reused


def requests(scenario: Scenario) -> list[SimRequest]:
    """The scenario's requests in arrival order, ids 0.., phases per ``phase_at``."""
    arrivals = random.Random(f"arrivals:{scenario.seed}")
    sessions = _sessions(
        scenario.seed, scenario.lengths, scenario.reuse, random.Random(f"content:{scenario.seed}")
    )
    peak = scenario.peak_rate / scenario.session_requests
    found: list[tuple[float, int, tuple[int, ...]]] = []
    t_s = -LEAD_S  # sessions under way at 0 (their earlier requests are not kept)
    while True:
        t_s += arrivals.expovariate(peak)
        if t_s >= scenario.duration_s:
            break
        if arrivals.random() * scenario.peak_rate >= scenario.rate_at(t_s):
            continue  # thinned
        found += [
            (t_s + offset_s, tokens, ids)
            for offset_s, tokens, ids in next(sessions)
            if 0.0 <= t_s + offset_s < scenario.duration_s
        ]
    found.sort(key=lambda r: r[0])  # stable: a session's requests keep their order
    return [
        SimRequest(i, t, tokens, ids, scenario.phase_at(t))
        for i, (t, tokens, ids) in enumerate(found)
    ]


# -- measures --------------------------------------------------------------------------


def unbounded_reuse(reqs: Sequence[SimRequest]) -> list[int]:
    """Per request (in the given order), the tokens an unbounded cache would reuse:
    its leading blocks that an earlier request had (at most all but its last token)."""
    seen: set[int] = set()
    return [_reused_blocks(r.input_tokens, r.block_ids, seen) * BLOCK_TOKENS for r in reqs]


def measure(scenario: Scenario, reqs: Sequence[SimRequest]) -> dict[str, float]:
    """What the requests realise: their rate and load, the token reuse of an
    unbounded cache, the share of long requests, the mean input length."""
    tokens = sum(r.input_tokens for r in reqs)
    rate = len(reqs) / scenario.duration_s
    return {
        "requests": len(reqs),
        "rate": rate,
        "load": rate / scenario.saturation_rate,
        "token_reuse": sum(unbounded_reuse(reqs)) / tokens if tokens else 0.0,
        "long_share": sum(r.input_tokens > LONG_TOKENS for r in reqs) / len(reqs) if reqs else 0.0,
        "mean_input_tokens": tokens / len(reqs) if reqs else 0.0,
    }
