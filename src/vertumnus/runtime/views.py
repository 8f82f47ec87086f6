"""What the REST API shows of the coordinator: workers, composition, cache.

Read-only snapshots as plain JSON-ready dicts; nothing here changes state.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vertumnus.policy.timeline import worker_rows

if TYPE_CHECKING:
    from vertumnus.runtime.coordinator import Coordinator


def workers_view(coord: Coordinator) -> list[dict[str, Any]]:
    """``timeline.worker_rows`` (what a simulation's report shows too), plus where
    the ranks run: host names, process ids, and whether the worker is restarting."""
    pool = coord.ranks
    rows = worker_rows(coord.policy, coord.clock())
    for row in rows:
        ranks = row["ranks"]
        row["host_names"] = list(
            dict.fromkeys(pool.host_of(r) for r in ranks) if pool is not None else ()
        )
        row["pids"] = [pool.pid(r) if pool is not None else None for r in ranks]
        row["restarting"] = coord.recovery.recovering(row["worker"])
    return rows


def composition_view(coord: Coordinator) -> dict[str, Any]:
    lattice = coord.policy.lattice
    return {
        "composition": coord.composition_name(),
        "epoch": lattice.epoch,
        "devices": lattice.config.num_devices,
        "degrees": list(lattice.config.degrees),
        "layout": lattice.layout(),
        # Where the start came from: "config" (given), or [pool] composition = "auto"'s
        # source: "start_workload", "state_file" or "builtin_mix" (config/start.py)
        "start_source": "config" if coord.cfg.start is None else coord.cfg.start.source,
        # The controller and its latest decisions (the what-if controller's list the
        # candidates it weighed, their predicted mean TTFT, the margin, the choice).
        "controller": {
            "mode": coord.cfg.policy.controller.mode,
            "adaptive": coord.cfg.policy.adaptive,
            "period_s": coord.cfg.policy.controller.period_s,
            "decisions": list(coord.decisions)[-10:],
        },
    }


def cache_view(coord: Coordinator) -> dict[str, Any]:
    trie = coord.policy.cache.trie
    return {
        "nodes": len(trie.nodes),
        "block_size": trie.block_tokens,
        "holders": {str(w): len(nodes) for w, nodes in trie.worker_nodes.items()},
        "token_hit_rate": coord.metrics.hit_rate(),
        "replications": coord.metrics.replication_count,
        "reclamations": coord.metrics.reclamation_count,
        # What the copies did (``policy/cache/audit.py``): per kind, blocks installed,
        # reused and evicted unused, the waste fraction; and the latest ten scans.
        "audit": coord.policy.cache.audit.summary(),
        "scans": [r.as_dict() for r in list(coord.policy.cache.audit.scans)[-10:]],
    }
