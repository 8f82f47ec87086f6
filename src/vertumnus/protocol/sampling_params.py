"""What a request asks of its token choice (``SamplingParams``, checked on
construction) and what one chosen token reports back (``TokenLogprobs``). Plain
values: the sampling model that reads them, over torch logits, is
``decode/sampling.py``."""

from __future__ import annotations

from dataclasses import dataclass, replace

# Temperatures below this are greedy (as vLLM does): dividing by them overflows.
GREEDY_BELOW = 1e-5
# What a log-probability of -inf is reported as (JSON has no infinity; vLLM's value).
LOGPROB_FLOOR = -9999.0


@dataclass(frozen=True)
class SamplingParams:
    """How one request chooses its tokens. ``temperature`` 0: greedy (``top_p``,
    ``top_k``, ``min_p`` and ``seed`` are then unused); ``seed`` None: a random seed
    for this sequence; ``top_k`` 0: every id."""

    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()

    def __post_init__(self) -> None:
        if not self.temperature >= 0:  # also refuses NaN
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0: every id), got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not self.repetition_penalty > 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @property
    def penalized(self) -> bool:
        """Whether the ids seen so far change the logits."""
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )

    def for_copy(self, index: int) -> SamplingParams:
        """The parameters of copy ``index`` of an ``n``-way request: its own seed."""
        if self.seed is None or index == 0:
            return self
        return replace(self, seed=self.seed + index)


@dataclass(frozen=True)
class TokenLogprobs:
    """One token's raw log-probability and the ``k`` most likely ids at its position
    (most likely first)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()
