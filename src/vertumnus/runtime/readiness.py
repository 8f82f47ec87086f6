"""Whether the pool can dispatch a request now, and if not, why: what ``/ready`` says.

The pool is ready when it has started and is not stopping, its rank pool has not
failed, at least one worker is active (a candidate for placement), and no reshape
has run past its bound (``[server] reshape_timeout_s``; it is rolled back or
finished then, so this lasts a moment). A request that arrives while the pool is
not ready still waits for a worker that is coming (a reshape's new workers, a
restarting one), but a load balancer should send it elsewhere: ``/ready`` answers
503 with the reason. ``/health`` is the liveness probe and stays 200. The decode
side's own readiness (the local decode process) is the proxy's
(``server/proxy.py``). Read-only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from vertumnus.policy.lattice import WorkerState

if TYPE_CHECKING:
    from vertumnus.runtime.coordinator import Coordinator


def unready_reason(coord: Coordinator) -> str | None:
    """None when the pool can dispatch now; else why not, in words."""
    if not coord.ready:
        return coord.rank_error or ("the server is stopping" if coord.stopping else "starting")
    workers = list(coord.policy.lattice.workers.values())
    if not any(w.state is WorkerState.ACTIVE for w in workers):
        return "no worker can take requests now: " + _why_none(coord)
    overdue = coord.reshaping.overdue()
    if overdue:
        t = overdue[0]
        return (
            f"the {t.op.kind} of workers {list(t.op.sources)} is past [server] "
            f"reshape_timeout_s = {coord.cfg.reshape_timeout_s:g} s"
        )
    return None


def _why_none(coord: Coordinator) -> str:
    """What every worker is doing instead of serving."""
    transitions = coord.policy.transitions
    parts = [f"a {t.op.kind} of workers {list(t.op.sources)} is {t.phase}" for t in transitions]
    restarting = sorted(
        w.worker_id
        for w in coord.policy.lattice.workers.values()
        if w.state is WorkerState.UNAVAILABLE
    )
    if restarting:
        parts.append(f"workers {restarting} are out (a rank failed)")
    return "; ".join(parts) or "none is active"
