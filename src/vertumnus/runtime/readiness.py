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

from collections.abc import Callable, Sequence

from vertumnus.policy.lattice import WorkerState
from vertumnus.policy.pool_policy import PoolPolicy
from vertumnus.policy.transition import Transition


def unready_reason(
    started: bool,
    failure: str | None,
    stopping: bool,
    policy: PoolPolicy,
    overdue: Callable[[], Sequence[Transition]],
    reshape_timeout_s: float,
) -> str | None:
    """None when the pool can dispatch now; else why not, in words. ``started``: the
    ranks are up and the pool is not stopping; ``failure``: why the ranks failed, if
    they did; ``overdue()``: the reshapes past ``reshape_timeout_s``."""
    if not started:
        return failure or ("the server is stopping" if stopping else "starting")
    workers = list(policy.lattice.workers.values())
    if not any(w.state is WorkerState.ACTIVE for w in workers):
        return "no worker can take requests now: " + _why_none(policy)
    late = overdue()
    if late:
        t = late[0]
        return (
            f"the {t.op.kind} of workers {list(t.op.sources)} is past [server] "
            f"reshape_timeout_s = {reshape_timeout_s:g} s"
        )
    return None


def _why_none(policy: PoolPolicy) -> str:
    """What every worker is doing instead of serving."""
    parts = [
        f"a {t.op.kind} of workers {list(t.op.sources)} is {t.phase}" for t in policy.transitions
    ]
    restarting = sorted(
        w.worker_id for w in policy.lattice.workers.values() if w.state is WorkerState.UNAVAILABLE
    )
    if restarting:
        parts.append(f"workers {restarting} are out (a rank failed)")
    return "; ".join(parts) or "none is active"
