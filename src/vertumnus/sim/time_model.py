"""How long things take in a simulated pool: the simulator's only model of time.

    a prefill      the policy's E_C(L - P, P) from the profile, at the prefix P the
                   worker really reused, plus ``dispatch_s`` (the serving path's own
                   time around the ranks' compute, which keeps the worker busy: 0 for
                   GPU studies; the CPU server measures about 1.6 ms), times a
                   log-normal factor of mean 1 when ``noise_cv`` > 0
    a KV copy      ``transfer_latency_s`` + each block moved between devices,
                   block_tokens * kv_bytes_per_token bytes at NVLink speed within a
                   host of ``devices_per_host`` and network speed between hosts (a
                   move within one device is free); copies do not slow prefills
    a switch       ``switch_s`` from the commit of a reshape's epoch until every rank
                   of its new workers acknowledged (0.5 s: the paper's "under one
                   second"; the CPU server switches in about 10 ms)
    T_ext          after the prefill, until the client has its first token (the
                   paper's T_ext: the KV hand-off to a decode server and its first
                   step): ``ext_latency_s`` + (input tokens - 1) *
                   ``kv_bytes_per_token`` / ``handoff_bytes_s`` (0: no hand-off, the
                   TTFT ends with the prefill, as a prefill-only pool's does);
                   measured by ``tools/bench/handoff.py`` and the decode server

``SimSettings`` holds these knobs and the run's own (seed, SLO, where t = 0 falls in
the controller's window). Every policy knob is ``PolicyConfig``'s. The parity test's
fake ranks take their service times from here too, so the simulator and the
coordinator run on one clock model. Pure Python.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from vertumnus.slo import DEFAULT_TTFT_SLO, TtftSlo


class SimulationError(ValueError):
    """Settings or a workload the simulator cannot run."""


@dataclass(frozen=True)
class SimSettings:
    seed: int = 0
    kv_bytes_per_token: int = 98_304  # Qwen3-30B-A3B: 48 layers x K,V x 4 heads x 128 x 2 B
    # The copy model's host size, unless [pool] devices_per_host gives the lattice one.
    devices_per_host: int = 8
    intra_host_bytes_s: float = 300e9
    inter_host_bytes_s: float = 50e9
    transfer_latency_s: float = 1e-3
    switch_s: float = 0.5
    dispatch_s: float = 0.0
    # T_ext: the hand-off's bandwidth (0: none) and its fixed part with the first step
    handoff_bytes_s: float = 0.0
    ext_latency_s: float = 0.0
    noise_cv: float = 0.0
    # Where t = 0 falls in the controller's first window (seconds into it): to line
    # the windows up with a real server's, whose windows run from when it started.
    window_phase_s: float = 0.0
    slo: TtftSlo = field(default_factory=lambda: DEFAULT_TTFT_SLO)
    # A deliberately wrong profile: the policy sees degree C's coefficients times
    # profile_bias[C] (0.85: 15 % optimistic) while prefills take the true time.
    profile_bias: Mapping[int, float] = field(default_factory=dict)
    # The timeline's period (``policy/timeline.py``, the report's charts); 0: the
    # arrivals' span over 500. Its window: the controller's period, or 5 samples.
    sample_s: float = 0.0

    def __post_init__(self) -> None:
        bias = {int(c): float(f) for c, f in dict(self.profile_bias).items()}
        object.__setattr__(self, "profile_bias", bias)
        if any(not f > 0 for f in bias.values()):
            raise SimulationError(f"profile_bias factors must be > 0, got {bias}")
        if self.kv_bytes_per_token < 1 or self.devices_per_host < 1:
            raise SimulationError("kv_bytes_per_token and devices_per_host must be >= 1")
        if not (
            self.switch_s >= 0
            and self.noise_cv >= 0
            and self.dispatch_s >= 0
            and self.transfer_latency_s >= 0
            and self.handoff_bytes_s >= 0
            and self.ext_latency_s >= 0
            and self.sample_s >= 0
            and self.intra_host_bytes_s > 0
            and self.inter_host_bytes_s > 0
        ):
            raise SimulationError(
                "need switch_s >= 0, noise_cv >= 0, dispatch_s >= 0, transfer_latency_s >= 0, "
                "handoff_bytes_s >= 0, ext_latency_s >= 0, sample_s >= 0 and positive bandwidths"
            )


class TimeModel:
    def __init__(self, settings: SimSettings, block_tokens: int) -> None:
        self.s = settings
        self.block_bytes = block_tokens * settings.kv_bytes_per_token
        self._rng = random.Random(settings.seed)
        self._sigma = math.sqrt(math.log1p(settings.noise_cv**2)) if settings.noise_cv else 0.0

    def prefill_s(self, exec_s: float, cp_degree: int | None = None) -> float:
        """Seconds a prefill keeps its worker busy, from the predicted E (undone by
        the profile's bias at that degree)."""
        if cp_degree is not None:
            exec_s /= self.s.profile_bias.get(cp_degree, 1.0)
        seconds = exec_s + self.s.dispatch_s
        if self._sigma:
            sigma = self._sigma
            seconds *= self._rng.lognormvariate(-sigma * sigma / 2, sigma)
        return seconds

    def copy_s(self, moves: Iterable[tuple[int, int, int, int]]) -> float:
        """Seconds a KV copy takes: (src device, src slot, dst device, dst slot) moves."""
        seconds = self.s.transfer_latency_s
        host = self.s.devices_per_host
        for src, _, dst, _ in moves:
            if src == dst:
                continue
            same_host = src // host == dst // host
            seconds += self.block_bytes / (
                self.s.intra_host_bytes_s if same_host else self.s.inter_host_bytes_s
            )
        return seconds

    def ext_s(self, input_tokens: int) -> float:
        """T_ext of a request: its KV hand-off and first decode step."""
        return self.s.ext_latency_s + (self.handoff_s(input_tokens) or 0.0)

    def handoff_s(self, input_tokens: int) -> float | None:
        """How long the prompt's KV is pulled by the decode server, its blocks held on
        the worker meanwhile (None: no hand-off is modelled)."""
        if not self.s.handoff_bytes_s:
            return None
        return max(0, input_tokens - 1) * self.s.kv_bytes_per_token / self.s.handoff_bytes_s

    @property
    def switch_s(self) -> float:
        return self.s.switch_s
