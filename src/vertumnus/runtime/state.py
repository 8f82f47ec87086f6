"""What the coordinator's parts share, in one typed bundle: ``Shared``.

The coordinator (the composition root) builds it once and hands it to each part,
beside the few collaborators a part uses (parts built before it). It holds no
behaviour of its own: the serving configuration and the served model, the profile,
the policy stack, the metrics, the pool's health, the clock, the ranks as they are
now (``ranks.CurrentRanks``: none before the start and after the close), the background
tasks, and the switchboard that carries a part's intents to the part that does them
(``runtime/intents.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from vertumnus.config import ModelConfig
from vertumnus.perfmodel import Profile
from vertumnus.policy.pool_policy import PoolPolicy
from vertumnus.runtime.background import Background
from vertumnus.runtime.health import Health
from vertumnus.runtime.intents import Routes
from vertumnus.runtime.metrics import Metrics
from vertumnus.runtime.ranks import CurrentRanks
from vertumnus.runtime.serve_config import ServeConfig


@dataclass(frozen=True)
class Shared:
    """``clock``: the time (``time.monotonic``, or the event loop's own, simulated,
    clock in the parity test); ``switchboard``: where a part hands its intents."""

    cfg: ServeConfig
    model: ModelConfig
    profile: Profile
    policy: PoolPolicy
    metrics: Metrics
    health: Health
    clock: Callable[[], float]
    ranks: CurrentRanks
    background: Background
    switchboard: Routes
