"""Helpers for tests that drive a live ``Coordinator`` on CPU ranks."""

from __future__ import annotations

from vertumnus.policy.lattice import WorkerState
from vertumnus.runtime.coordinator import Coordinator
from vertumnus.runtime.request_path import PrefillResult


async def only(coord: Coordinator, worker: int, prompt: list[int]) -> PrefillResult:
    """Prefill with every other worker out of the candidate set."""
    others = [w for w in coord.lattice.workers.values() if w.worker_id != worker]
    for w in others:
        w.state = WorkerState.UNAVAILABLE
    try:
        return await coord.prefill(prompt)
    finally:
        for w in others:
            w.state = WorkerState.ACTIVE
