"""The scenarios' sessions: a family's requests generated as sessions of prompts.

A session is one request, a conversation or an agent's run (``sim/families.py``);
its requests' times are relative to its start. Block ids name whole prefixes: a
request's block j has the id of block j of an earlier request only if both hold
the same tokens up to the end of that block (a hot prompt's full blocks, the
previous turn's full blocks); every other block gets a fresh random id. So the
reusable prefix of a request with an unbounded cache is its run of leading blocks
already seen (``unbounded_reuse``), as a prefix-chain hash would give.

Deterministic for a seed. Pure Python. Not owned here: when sessions start
(``sim/scenarios.py``).
"""

from __future__ import annotations

import bisect
import itertools
import math
import random
from collections.abc import Iterator, Sequence

from vertumnus.blocks import max_reuse_blocks
from vertumnus.sim.families import (
    LONG_TOKENS,
    MAX_TOKENS,
    Agents,
    Conversations,
    LengthMix,
    Reuse,
    SystemPrompts,
    log_uniform,
)
from vertumnus.sim.workload import SimRequest

BLOCK_TOKENS = 512  # the traces' and the default engine's block


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
        return int(log_uniform(rng, LONG_TOKENS + 1, MAX_TOKENS))
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


def family_sessions(
    seed: int, lengths: LengthMix, reuse: Reuse, rng: random.Random
) -> Iterator[Session]:
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
    for session in family_sessions(seed, lengths, reuse, random.Random(f"mix:{seed}")):
        for k, (_, tokens, ids) in enumerate(session):
            yield k == 0, tokens, reused_blocks(tokens, ids, seen) * BLOCK_TOKENS


def reused_blocks(tokens: int, ids: Sequence[int], seen: set[int]) -> int:
    limit = min(len(ids), max_reuse_blocks(tokens, BLOCK_TOKENS))
    reused = 0
    while reused < limit and ids[reused] in seen:
        reused += 1
    seen.update(ids)
    return reused


def unbounded_reuse(reqs: Sequence[SimRequest]) -> list[int]:
    """Per request (in the given order), the tokens an unbounded cache would reuse:
    its leading blocks that an earlier request had (at most all but its last token)."""
    seen: set[int] = set()
    return [reused_blocks(r.input_tokens, r.block_ids, seen) * BLOCK_TOKENS for r in reqs]
