"""What the REST API shows of the coordinator: workers, composition, cache.

Read-only snapshots as plain JSON-ready dicts; nothing here changes state.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from typing import Any

from vertumnus.policy.pool_policy import PoolPolicy
from vertumnus.policy.timeline import worker_rows
from vertumnus.runtime.kv.host_memory import HostTierMemory
from vertumnus.runtime.metrics import Metrics
from vertumnus.runtime.ranks import Ranks
from vertumnus.runtime.serve_config import ServeConfig


def workers_view(
    policy: PoolPolicy, ranks: Ranks | None, now: float, restarting: Collection[int]
) -> list[dict[str, Any]]:
    """``timeline.worker_rows`` (what a simulation's report shows too), plus where
    the ranks run: host names, process ids, and whether the worker is restarting (in
    ``restarting``)."""
    rows = worker_rows(policy, now)
    for row in rows:
        members = row["ranks"]
        row["host_names"] = list(
            dict.fromkeys(ranks.host_of(r) for r in members) if ranks is not None else ()
        )
        row["pids"] = [ranks.pid(r) if ranks is not None else None for r in members]
        row["restarting"] = row["worker"] in restarting
    return rows


def composition_view(
    policy: PoolPolicy, name: str, cfg: ServeConfig, decisions: Iterable[dict[str, Any]]
) -> dict[str, Any]:
    """The composition ``name`` and the lattice under it, where the start came from,
    and the controller with its latest ``decisions``."""
    lattice = policy.lattice
    return {
        "composition": name,
        "epoch": lattice.epoch,
        "devices": lattice.config.num_devices,
        "degrees": list(lattice.config.degrees),
        "layout": lattice.layout(),
        # Where the start came from: "config" (given), or [pool] composition = "auto"'s
        # source: "start_workload", "state_file" or "builtin_mix" (config/start.py)
        "start_source": "config" if cfg.start is None else cfg.start.source,
        # The controller and its latest decisions (the what-if controller's list the
        # candidates it weighed, their predicted mean TTFT, the margin, the choice).
        "controller": {
            "mode": cfg.policy.controller.mode,
            "adaptive": cfg.policy.adaptive,
            "period_s": cfg.policy.controller.period_s,
            "decisions": list(decisions)[-10:],
        },
    }


def cache_view(
    policy: PoolPolicy, metrics: Metrics, tier: HostTierMemory | None = None
) -> dict[str, Any]:
    trie = policy.cache.trie
    return {
        "nodes": len(trie.nodes),
        "block_size": trie.block_tokens,
        "holders": {str(w): len(nodes) for w, nodes in trie.worker_nodes.items()},
        "token_hit_rate": metrics.hit_rate(),
        "replications": metrics.replication_count,
        "reclamations": metrics.reclamation_count,
        # What the copies did (``policy/cache/audit.py``): per kind, blocks installed,
        # reused and evicted unused, the waste fraction; and the latest ten scans.
        "audit": policy.cache.audit.summary(),
        "scans": [r.as_dict() for r in list(policy.cache.audit.scans)[-10:]],
        "host_tier": tier_view(policy, tier),
    }


def tier_view(policy: PoolPolicy, tier: HostTierMemory | None) -> dict[str, Any] | None:
    """The host tier (None: none): the policy's figures (``HostTierPolicy.summary``: what it
    holds, demoted, loaded back, evicted), its size, and the copies this process made
    and their time."""
    if tier is None:
        return None
    return {
        **policy.tiers.summary(),
        "capacity_bytes": tier.capacity_bytes,
        "copied_in_blocks": tier.demoted,
        "copied_out_blocks": tier.loaded,
        "copy_s": tier.copy_s,
    }
