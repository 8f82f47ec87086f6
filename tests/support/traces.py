"""Small Mooncake-format traces that tests write for themselves."""

from __future__ import annotations

import json
import random
from pathlib import Path


def write_trace(path: Path, seed: int = 5, burst_rate: float = 30.0) -> None:
    """A burst (10 s at ``burst_rate`` req/s) then a quiet spell (40 s at 2 req/s) of turns of 40
    conversations; every request starts with the shared block 0, then its
    conversation so far (every earlier turn), then its own new blocks (512 tokens
    each, as Mooncake)."""
    rng = random.Random(seed)
    sessions: list[list[int]] = [[] for _ in range(40)]
    weights = [1.0 / (k + 1) for k in range(len(sessions))]
    next_block = 1
    t, lines = 0.0, []
    for duration, rate in ((10.0, burst_rate), (40.0, 2.0)):
        end = t + duration
        while True:
            t += rng.expovariate(rate)
            if t >= end:
                t = end
                break
            s = rng.choices(range(len(sessions)), weights)[0]
            if len(sessions[s]) > 12:
                sessions[s] = []  # the conversation ends; a new one takes its place
            new = list(range(next_block, next_block + rng.randint(1, 3)))
            next_block += len(new)
            hashes = [0, *sessions[s], *new]
            sessions[s] += new
            length = 512 * len(hashes) - rng.randrange(512)
            lines.append(
                json.dumps(
                    {
                        "timestamp": round(t * 1000),
                        "hash_ids": hashes,
                        "input_length": length,
                        "output_length": 1,
                    }
                )
            )
    path.write_text("\n".join(lines) + "\n")
