"""Every router by its configuration name (``[scheduler] policy``, ``--policy``).

    vertumnus           the cost rule (``scheduler.py``)
    round-robin, least-load, cache-first, length-threshold
                        simple baselines (``baselines.py``)
    sglang-cache-aware, dynamo-kv, llm-d
                        the routers of SGLang, NVIDIA Dynamo and llm-d
                        (``peer_routers.py``)

``PolicyConfig`` refuses any other name, listing these. Pure Python.
"""

from __future__ import annotations

from vertumnus.policy.baselines import BASELINES
from vertumnus.policy.peer_routers import PEER_ROUTERS
from vertumnus.policy.scheduler import Scheduler

ROUTERS: dict[str, type[Scheduler]] = {"vertumnus": Scheduler, **BASELINES, **PEER_ROUTERS}
