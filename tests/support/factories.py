"""Factories of plain values that many tests need: seeded token ids, the engine
settings of every test that runs ranks on CPU, and hand-written profiles. No torch
and no processes: any test may import this."""

from __future__ import annotations

import random
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from vertumnus.config import PRESETS, EngineConfig, ModelConfig
from vertumnus.perfmodel import DegreeCoeffs, Profile

# The preset most tests run: seeded random weights, built in every rank process.
TINY: ModelConfig = PRESETS["tiny"]
BLOCK_SIZE = 16  # tokens per KV block, EngineConfig's default
# Rank start-up and per-step deadline: spawned ranks import torch and rendezvous,
# which takes seconds on 2 shared cores; a hung step fails after this long.
RANK_TIMEOUT_S = 60.0


def make_tokens(n: int, seed: int, vocab: int = TINY.vocab_size) -> list[int]:
    """``n`` token ids in [0, vocab), the same for the same (n, seed, vocab)."""
    rng = random.Random(seed)
    return [rng.randrange(vocab) for _ in range(n)]


def engine_config(**overrides: Any) -> EngineConfig:
    """CPU, fp32, eager layers (compiling costs each rank seconds at start; the
    compiled path has its own tests and serves the e2e default), ``BLOCK_SIZE``-token
    blocks, one intra-op thread per rank (ranks outnumber the cores here) and
    ``RANK_TIMEOUT_S``; ``overrides`` on top."""
    base: dict[str, Any] = dict(
        block_size=BLOCK_SIZE,
        device="cpu",
        dtype="float32",
        compile="off",
        threads_per_rank=1,
        rank_timeout_s=RANK_TIMEOUT_S,
    )
    base.update(overrides)
    return EngineConfig(**base)


def make_profile(
    coeffs: Mapping[int, DegreeCoeffs],
    kappa_s: Mapping[int, float] | None = None,
    *,
    model: str = "m",
    hardware: str = "h",
    block_size: int = BLOCK_SIZE,
    provenance: Mapping[str, Any] | None = None,
) -> Profile:
    """A profile of made-up coefficients per degree; ``kappa_s`` (per degree, the
    capacity the controller reads) fills ``capacity`` as ``{"kappa_s": ...}``."""
    profile = Profile(model, hardware, block_size, dict(coeffs), provenance=dict(provenance or {}))
    if kappa_s is not None:
        profile.capacity = {c: {"kappa_s": k} for c, k in kappa_s.items()}
    return profile


def cpu_profile(folder: Path) -> str:
    """A profile of degrees 1 and 2 for ``tiny`` on CPU ranks (made-up coefficients of
    the measured size), saved in ``folder``: the path, for a ``ServeConfig``."""
    coeffs = {
        1: DegreeCoeffs(d=0.004, c=3e-5, alpha=3e-8),
        2: DegreeCoeffs(d=0.009, c=4e-5, alpha=2e-8),
    }
    path = folder / "profile.json"
    make_profile(coeffs, {1: 10.0, 2: 15.0}, model="tiny", hardware="cpu").save(path)
    return str(path)
