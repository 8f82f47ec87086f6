"""The scenarios' workload families: how long requests are, and how they share prefixes.

Reuse families (``Reuse``): ``none``; ``system`` (a few hot prompts of 1-16K
tokens with Zipf popularity begin a share of the requests); ``conversation``
(turn k's prompt is turn k-1's, plus its answer, plus a new user message; think
times of seconds to a minute); ``agent`` (a tool prompt per agent type, then a
context that grows by short steps, gaps of 1 to a few seconds: a step's answer
comes before the next step). The length mix (``LengthMix``) draws the new content
of a session's first request: log-normal with a median of 1-8K tokens, or with
probability ``long_share`` (0-25 %) log-uniform over 32K-128K; a session ends
before a request past 128K.

``draw_reuse`` draws a family's knobs. Pure Python. Not owned here: the sessions
they generate (``sim/sessions.py``), the rest of a scenario (``sim/scenarios.py``).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

LONG_TOKENS = 32_768  # a request over this is long (the controller's default)
MAX_TOKENS = 131_072
FAMILIES = ("none", "system", "conversation", "agent")


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


def log_uniform(rng: random.Random, lo: float, hi: float) -> float:
    return math.exp(rng.uniform(math.log(lo), math.log(hi)))


def draw_reuse(family: str, rng: random.Random) -> Reuse:
    """The knobs of ``family`` (one of ``FAMILIES``), drawn from ``rng``."""
    if family == "system":
        prompts = tuple(int(log_uniform(rng, 1024, 16384)) for _ in range(rng.randint(1, 8)))
        return SystemPrompts(prompts, rng.uniform(0.5, 1.5), rng.uniform(0.1, 1.0))
    if family == "conversation":
        return Conversations(
            rng.uniform(1.0, 4.0),
            rng.randint(100, 800),
            int(log_uniform(rng, 100, 2000)),
            rng.uniform(10.0, 60.0),
        )
    if family == "agent":
        tools = tuple(int(log_uniform(rng, 1024, 8192)) for _ in range(rng.randint(1, 6)))
        return Agents(
            tools,
            rng.uniform(0.0, 1.2),
            rng.uniform(1.0, 3.0),
            int(log_uniform(rng, 100, 1500)),
            rng.uniform(2.0, 6.0),
        )
    return NoReuse()
