"""Choosing the next token from fp32 logits: greedy, or seeded sampling with
``temperature`` and ``top_p`` (nucleus).

Pure functions over logits and a per-sequence ``torch.Generator``: no model, no
state of their own. A sequence's generator is seeded once from its request's
``seed`` (a random one when the request gives none), so the same seed on the same
device draws the same tokens whether the sequence decodes alone or in a batch.

The sampling model, per row of logits ``z`` [V]:

    temperature < GREEDY_BELOW      argmax(z) (ties: the lowest id, as torch.argmax)
    otherwise                       p = softmax(z / temperature); keep the smallest
                                    set of most likely ids whose mass reaches top_p
                                    (at least the most likely one), renormalise,
                                    draw one id from it with the generator
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

# Temperatures below this are greedy (as vLLM does): dividing by them overflows.
GREEDY_BELOW = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    """How one request chooses its tokens. ``temperature`` 0: greedy (``top_p`` and
    ``seed`` are then unused); ``seed`` None: a random seed for this request."""

    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        if not self.temperature >= 0:  # also refuses NaN
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW


def make_generator(params: SamplingParams, device: torch.device) -> torch.Generator | None:
    """The sequence's own generator on ``device`` (None for greedy: it draws nothing)."""
    if params.greedy:
        return None
    seed = params.seed if params.seed is not None else secrets.randbits(63)
    return torch.Generator(device=device).manual_seed(seed)


def nucleus_probs(logits: Tensor, temperature: float, top_p: float) -> Tensor:
    """[V] fp32 logits -> [V] probabilities after temperature and top-p truncation."""
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p >= 1.0:
        return probs
    sorted_probs, order = torch.sort(probs, descending=True)
    # Keep an id while the mass of the ids before it is below top_p: the first id is
    # always kept, and the kept set is the smallest whose mass reaches top_p.
    mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
    sorted_probs = sorted_probs.masked_fill(mass_before >= top_p, 0.0)
    kept = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
    return kept / kept.sum()


def sample(logits: Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """One token id from [V] fp32 logits."""
    if params.greedy:
        return int(torch.argmax(logits))
    if generator is None:
        raise ValueError("sampling with temperature > 0 needs the sequence's generator")
    probs = nucleus_probs(logits, params.temperature, params.top_p)
    return int(torch.multinomial(probs, 1, generator=generator))


def sample_rows(
    logits: Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
) -> list[int]:
    """One token id per row of [N, V] fp32 logits, row i by ``params[i]`` with
    ``generators[i]``. Greedy rows share one argmax over the batch (one device sync)."""
    if not len(params) == len(generators) == logits.shape[0]:
        raise ValueError(
            f"{logits.shape[0]} rows of logits, {len(params)} params, {len(generators)} generators"
        )
    chosen = torch.argmax(logits, dim=-1).tolist()
    for i, (p, gen) in enumerate(zip(params, generators, strict=True)):
        if not p.greedy:
            chosen[i] = sample(logits[i], p, gen)
    return [int(t) for t in chosen]
