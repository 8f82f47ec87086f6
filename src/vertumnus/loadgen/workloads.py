"""The load generator's workloads: the requests to send and when.

  * **Mooncake JSONL**: each ``hash_id`` becomes a deterministic block of token ids
    (seeded by the id), so equal hash ids give equal token prefixes. Each 512-token
    block becomes ``round(512 * length_scale)`` tokens, and the input length is
    scaled the same way, so a small machine keeps the trace's prefix structure.
    With ``length_scale`` = 1/32, one trace block is one 16-token engine block.
  * **Azure CSV**: lengths (scaled) and arrivals; random tokens, no shared prefix.
  * **random**: log-normal lengths.
  * **shared-prefix groups**: every request starts with one of ``prefix_groups``
    prefixes.

Arrivals come from the trace (divided by ``rate_scale``), or are Poisson or gamma at
``request_rate`` (``burstiness`` is the gamma shape). Deterministic for a seed. Not
owned here: sending them (``client``).
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

from vertumnus.traces import MOONCAKE_BLOCK_TOKENS, Trace


@dataclass(frozen=True)
class LoadRequest:
    index: int
    arrival_s: float  # from the start of the run
    token_ids: tuple[int, ...]
    block_hashes: tuple[int, ...] = ()  # the trace's prefix blocks (empty: none)
    block_tokens: int = 0  # tokens per entry of block_hashes

    @property
    def input_tokens(self) -> int:
        return len(self.token_ids)


def block_of(hash_id: int, length: int, vocab: int, seed: int) -> list[int]:
    """The token ids standing for one trace block: a function of the hash id only."""
    rng = random.Random(hash_id * 1_000_003 + seed)
    return [rng.randrange(vocab) for _ in range(length)]


def from_trace(
    trace: Trace, length_scale: float, vocab: int, seed: int = 0, rate_scale: float = 1.0
) -> list[LoadRequest]:
    if not (length_scale > 0 and rate_scale > 0):
        raise ValueError("length_scale and rate_scale must be > 0")
    block_len = max(1, round(MOONCAKE_BLOCK_TOKENS * length_scale))
    rng = random.Random(seed)
    out = []
    for i, r in enumerate(trace.requests):
        n = max(1, round(r.input_tokens * length_scale))
        if r.block_hashes:
            tokens: list[int] = []
            for h in r.block_hashes:
                tokens += block_of(h, block_len, vocab, seed)
                if len(tokens) >= n:
                    break
            tokens = tokens[:n]
            hashes = r.block_hashes
        else:
            tokens = [rng.randrange(vocab) for _ in range(n)]
            hashes = ()
        out.append(LoadRequest(i, r.arrival_s / rate_scale, tuple(tokens), hashes, block_len))
    return out


def synthetic(
    num_requests: int,
    median_tokens: int,
    sigma: float,
    vocab: int,
    seed: int = 0,
    prefix_groups: int = 0,
    prefix_tokens: int = 0,
) -> list[LoadRequest]:
    """Log-normal lengths; with groups, each request starts with a group's prefix."""
    rng = random.Random(seed)
    groups = [[rng.randrange(vocab) for _ in range(prefix_tokens)] for _ in range(prefix_groups)]
    out = []
    for i in range(num_requests):
        n = max(1, int(rng.lognormvariate(math.log(median_tokens), sigma)))
        head = groups[rng.randrange(len(groups))][:n] if groups else []
        tail = [rng.randrange(vocab) for _ in range(n - len(head))]
        out.append(LoadRequest(i, 0.0, tuple(head + tail)))
    return out


def with_arrivals(
    requests: Sequence[LoadRequest], request_rate: float, burstiness: float, seed: int
) -> list[LoadRequest]:
    """Poisson (burstiness 1) or gamma arrivals at ``request_rate`` per second."""
    if not (request_rate > 0 and burstiness > 0):
        raise ValueError("request_rate and burstiness must be > 0")
    rng = random.Random(seed)
    t, out = 0.0, []
    for r in requests:
        out.append(LoadRequest(r.index, t, r.token_ids, r.block_hashes, r.block_tokens))
        t += rng.gammavariate(burstiness, 1.0 / (burstiness * request_rate))
    return out
