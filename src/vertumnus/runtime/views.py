"""What the REST API shows of the coordinator: workers, composition, cache.

Read-only snapshots as plain JSON-ready dicts; nothing here changes state.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vertumnus.runtime.coordinator import Coordinator


def workers_view(coord: Coordinator) -> list[dict[str, Any]]:
    policy, pool = coord.policy, coord.pool
    scheduler, lattice = policy.scheduler, policy.lattice
    now = coord.clock()
    out = []
    for w in sorted(lattice.workers.values(), key=lambda w: w.first_device):
        index = policy.indexes.get(w.worker_id)
        out.append(
            {
                "worker": w.worker_id,
                "cp_degree": w.cp_degree,
                "ranks": list(w.devices),
                "hosts": list(w.hosts(lattice.config)),
                "host_names": list(
                    dict.fromkeys(pool.host_of(r) for r in w.devices) if pool is not None else ()
                ),
                "state": str(w.state),
                "epoch": w.epoch,
                "queued": len(scheduler.queued(w.worker_id)),
                "running": scheduler.running(w.worker_id),
                "outstanding_s": scheduler.outstanding_s(w.worker_id, now),
                "cached_blocks": len(index) if index is not None else 0,
                "pids": [pool.pid(r) if pool is not None else None for r in w.devices],
                "restarting": coord.recovery.recovering(w.worker_id),
            }
        )
    return out


def composition_view(coord: Coordinator) -> dict[str, Any]:
    lattice = coord.policy.lattice
    return {
        "composition": coord.composition_name(),
        "epoch": lattice.epoch,
        "devices": lattice.config.num_devices,
        "degrees": list(lattice.config.degrees),
        "layout": lattice.layout(),
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
        # What the copies did (``policy/cache_audit.py``): per kind, blocks installed,
        # reused and evicted unused, the waste fraction; and the latest ten scans.
        "audit": coord.policy.cache.audit.summary(),
        "scans": [r.as_dict() for r in list(coord.policy.cache.audit.scans)[-10:]],
    }
