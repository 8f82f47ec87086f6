"""What a simulation returns: a record per request, a row per controller window,
a record per reshape, the decisions, the cache's copies and audit, and the pool's
timeline. Plain dataclasses, read by the report (``report``) and the plots
(``plots``)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from vertumnus.policy.cache.audit import ScanRecord
from vertumnus.policy.control.decision import Decision
from vertumnus.policy.timeline import Timeline


@dataclass
class RequestRecord:
    request_id: int
    arrival_s: float
    input_tokens: int
    phase: int
    cached_tokens: int = 0
    tier_tokens: int = 0  # of cached_tokens, loaded back from the host tier
    worker: int | None = None
    cp_degree: int | None = None
    start_s: float | None = None
    end_s: float | None = None
    tau_s: float = math.inf

    @property
    def ttft_s(self) -> float | None:
        return None if self.end_s is None else self.end_s - self.arrival_s


@dataclass
class WindowRow:
    window: int
    start_s: float
    end_s: float
    arrivals: int
    demand_s: float
    capacity_s: float
    composition: str
    long_fraction: float
    rule: str


@dataclass
class ReshapeRecord:
    kind: str
    started_s: float
    drain_s: float | None
    switch_s: float | None


@dataclass
class SimResult:
    records: list[RequestRecord]
    windows: list[WindowRow]
    reshapes: list[ReshapeRecord]
    decisions: list[Decision]
    copies: int
    blocks_copied: int
    reclaims: int
    # The cache manager's audit: per kind of copy, blocks installed, used, wasted
    # (``CopyAudit.summary``), and one record per scan.
    cache_audit: dict[str, Any]
    scans: list[ScanRecord]
    wall_s: float
    sim_end_s: float
    devices: int
    timeline: Timeline  # the pool sampled over the run, as the dashboard shows it
    workers: list[dict[str, Any]]  # at the run's end (``timeline.worker_rows``)
    host_tier: dict[str, Any] | None = None  # ``HostTierPolicy.summary`` (the host tier)
