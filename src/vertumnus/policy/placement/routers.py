"""Every router by its configuration name (``[scheduler] router``, ``--router``).

    vertumnus           the cost rule (``placement/scheduler.py``)
    round-robin, least-load, cache-first, length-threshold
                        simple baselines (``placement/baselines.py``)
    sglang-cache-aware, dynamo-kv, llm-d
                        the routers of SGLang, NVIDIA Dynamo and llm-d
                        (``placement/peers.py``)

``PolicyConfig`` refuses any other name, listing these. Pure Python.
"""

from __future__ import annotations

from vertumnus.policy.placement.baselines import BASELINES
from vertumnus.policy.placement.peers import PEER_ROUTERS
from vertumnus.policy.placement.scheduler import Scheduler

ROUTERS: dict[str, type[Scheduler]] = {"vertumnus": Scheduler, **BASELINES, **PEER_ROUTERS}
