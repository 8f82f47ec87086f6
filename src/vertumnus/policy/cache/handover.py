"""The prefix cache's hand-over when workers split or merge.

``merge`` and ``split`` move the old workers' prefixes to the new workers as
*pending* marks that remember which device still has each block (block j of a
degree-C worker on devices [f, f + C) lives on device f + j % C). A pending prefix
is not reusable; ``adopt`` plans index the blocks already in place under the new
geometry, and the first request that reuses the rest gets a ``fetch`` plan for its
missing blocks (``PrefixCacheManager.on_request``), or an ordinary miss when no
copy is left. ``reconciliation_traffic`` prices a reshaping before it is chosen.

Owned here: which prefixes each new worker inherits, from which device, and the
adopt plans. Not owned here: the plans' bookkeeping (``inflight``), the
fetch on first reuse (``fetches``), moving the KV (the driver).
"""

from __future__ import annotations

from collections.abc import Sequence

from vertumnus.policy.cache.inflight import PlansInFlight
from vertumnus.policy.cache.nodes import Node, WorkerInfo
from vertumnus.policy.cache.plans import BlockMove, CopyPlan
from vertumnus.policy.cache.trie import PrefixTrie


def merge(
    trie: PrefixTrie,
    plans: PlansInFlight,
    sources: Sequence[int],
    merged_id: int,
    cp_degree: int,
    first_device: int,
) -> list[CopyPlan]:
    """Sibling workers ``sources`` became one worker: combine their prefixes as
    pending marks of ``merged_id`` (a block retained on the device the merged
    geometry wants wins) and return the adopt plans of those already in place."""
    found = [_retained(trie, trie.worker(s)) for s in sources]
    for s in sources:
        plans.cancel_plans_of(s)
    merged = trie.add_worker(merged_id, cp_degree, first_device)
    retained: dict[Node, int | None] = {}
    for pairs in found:
        for node, device in pairs:
            if retained.get(node) is None or device == merged.device_of(node.depth):
                retained[node] = device
    for node, device in retained.items():
        trie.set_pending(node, merged_id, device)
    for s in sources:
        trie.remove_worker(s)
    return _adopt_plans(trie, plans, merged)


def split(
    trie: PrefixTrie,
    plans: PlansInFlight,
    parent_id: int,
    children: Sequence[tuple[int, int]],
    child_degree: int,
    capacity_blocks: int,
) -> list[CopyPlan]:
    """Worker ``parent_id`` became ``children`` (id, first device) of
    ``child_degree``: each retained prefix (a leaf chain of the parent's cache) goes
    to one child, by demand (most accessed first, to the child with the least
    demand so far) and room (``capacity_blocks`` per child). Returns the adopt
    plans for the blocks already in place."""
    retained = dict(_retained(trie, trie.worker(parent_id)))
    plans.cancel_plans_of(parent_id)
    has_child = {node.parent for node in retained if node.parent is not None}
    leaves = [node for node in retained if node not in has_child]

    def demand(node: Node) -> float:
        return sum(node.access) if node.access is not None else 0.0

    leaves.sort(key=lambda n: (-demand(n), -n.depth, n.block_id))
    infos = [trie.add_worker(cid, child_degree, first) for cid, first in children]
    assigned: list[set[Node]] = [set() for _ in infos]
    load = [0.0] * len(infos)
    for leaf in leaves:
        # The prefix as this worker retains it (an ancestor it evicted is not).
        path = [z for z in leaf.path() if z in retained]
        best = None
        for i in range(len(infos)):
            new_blocks = sum(1 for z in path if z not in assigned[i])
            if len(assigned[i]) + new_blocks > capacity_blocks:
                continue
            key = (load[i], new_blocks, i)
            if best is None or key < best[0]:
                best = (key, i)
        if best is None:
            continue  # fits nowhere: not retained
        i = best[1]
        assigned[i].update(path)
        load[i] += demand(leaf)
    for info, nodes in zip(infos, assigned, strict=True):
        for node in nodes:
            trie.set_pending(node, info.worker_id, retained[node])
    trie.remove_worker(parent_id)
    adopt: list[CopyPlan] = []
    for info in infos:
        adopt += _adopt_plans(trie, plans, info)
    return adopt


def pending_leaves(trie: PrefixTrie, worker_id: int) -> list[Node]:
    """The ends of a worker's pending prefixes, most accessed first."""
    pending = trie.worker_pending[worker_id]
    inner = {node.parent for node in pending if node.parent is not None}

    def demand(node: Node) -> float:
        return sum(node.access) if node.access is not None else 0.0

    return sorted(pending - inner, key=lambda n: (-demand(n), -n.depth, n.block_id))


def reconciliation_traffic(
    trie: PrefixTrie, sources: Sequence[int], target_degree: int, target_firsts: Sequence[int]
) -> float:
    return reconciliation(trie, sources, target_degree, target_firsts)[0]


def reconciliation(
    trie: PrefixTrie, sources: Sequence[int], target_degree: int, target_firsts: Sequence[int]
) -> tuple[float, float]:
    """Expected KV reconciliation after reshaping ``sources`` into workers of
    ``target_degree`` at ``target_firsts``: the blocks they retain that are not
    where the new geometry wants them, each weighted by 1 + its recent accesses.
    A merge has one target; a split gives each prefix to one child, so a block
    counts by the share of children for which it is out of place:

        sum over retained z with wrong(z) > 0 of
            (1 + sum_C access[z, C]) * wrong(z) / |targets|,
        wrong(z) = #{targets f : device f + depth(z) % target_degree holds no copy of z}

    Returns (that traffic, the same sum with wrong(z) / |targets| taken as 1): their
    ratio is the share of the retained prefix weight a reshape disturbs.
    """
    devices: dict[Node, set[int]] = {}
    for s in sources:
        for node, device in _retained(trie, trie.worker(s)):
            if device is not None:
                devices.setdefault(node, set()).add(device)
    # Per depth residue, the devices that want the block there (one per target: the
    # targets are distinct workers).
    wanted = [frozenset(first + d for first in target_firsts) for d in range(target_degree)]
    n_targets = len(target_firsts)
    total = whole = 0.0
    for node, held_on in devices.items():
        wrong = n_targets - len(wanted[node.depth % target_degree] & held_on)
        weight = 1.0 + (sum(node.access) if node.access is not None else 0.0)
        whole += weight
        if wrong:
            total += weight * wrong / n_targets
    return total, whole


def _retained(trie: PrefixTrie, info: WorkerInfo) -> list[tuple[Node, int | None]]:
    """The worker's prefixes with the device that has each block: its held blocks,
    and the pending ones with their retained device."""
    # (``info.device_of``, inline: a decision's reconciliation walks thousands of blocks)
    first, c = info.first_device, info.cp_degree
    out: list[tuple[Node, int | None]] = [
        (node, first + node.depth % c) for node in trie.worker_nodes[info.worker_id]
    ]
    for node in trie.worker_pending[info.worker_id]:
        assert node.pending is not None
        out.append((node, node.pending[info.slot]))
    return out


def _adopt_plans(trie: PrefixTrie, plans: PlansInFlight, info: WorkerInfo) -> list[CopyPlan]:
    """One plan per maximal chain of pending blocks that are already in place."""
    pending = trie.worker_pending[info.worker_id]
    in_place: set[Node] = set()
    for node in sorted(pending, key=lambda n: n.depth):
        assert node.pending is not None
        device = node.pending[info.slot]
        parent_ok = node.parent is None or node.parent in in_place
        if parent_ok and device == info.device_of(node.depth):
            in_place.add(node)
    inner = {node.parent for node in in_place if node.parent is not None}
    adopt = []
    for leaf in sorted(in_place - inner, key=lambda n: n.block_id):
        moves = [
            BlockMove(z.block_id, z.depth, None, info.device_of(z.depth), info.device_of(z.depth))
            for z in leaf.path()
        ]
        adopt.append(plans.start_copy("adopt", info, moves, score=0.0))
    return adopt
