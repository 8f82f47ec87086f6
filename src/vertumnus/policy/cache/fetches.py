"""The copies the prefix-cache manager plans for one destination, outside the scan.

  * ``pull``: a request's MatchedPath past what its worker holds, when placement
    counted on it, from a holder of the whole of it (the first whose devices are
    free for the copy, then one of the destination's degree, so that nothing is
    re-sharded); an earlier copy bringing the same blocks is waited for instead;
  * ``fetch``: the missing blocks of a *pending* prefix the destination inherited
    through a split or merge (``handover``), on the first request that reuses it or
    right after its switch (``reconcile``): from the retained copy, else any
    holder; a block with no copy left ends the fetch (the rest is an ordinary miss,
    and its pending marks go);
  * ``by_hand``: a copy an operator (or a test) asks for.

Each new plan is started in the plans in flight (``inflight``). Pure Python,
clock-free. Not owned here: when to pull or fetch (``manager``), the scan's copies
(``scan``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from vertumnus.policy.cache import handover
from vertumnus.policy.cache.inflight import PlansInFlight
from vertumnus.policy.cache.nodes import Node, TrieError, WorkerInfo
from vertumnus.policy.cache.plans import BlockMove, CopyPlan
from vertumnus.policy.cache.trie import PrefixTrie


def pull(
    trie: PrefixTrie,
    plans: PlansInFlight,
    path: Sequence[Node],
    held: int,
    upto: int,
    dest: WorkerInfo,
    ready: Callable[[WorkerInfo, float], float] | None,
    now: float,
) -> tuple[CopyPlan | None, int | None]:
    """Blocks ``held`` to ``upto`` of ``path`` to ``dest`` (``ready(holder, now)``:
    seconds until the holder's devices are free for a copy; None: any): the new
    plan, and the plan the request waits for (an earlier copy bringing the same
    blocks, if there is one)."""
    last = path[upto - 1]
    for plan in plans.copies.values():
        if plan.dest_worker == dest.worker_id and last.block_id in plan.prefix_ids:
            return None, plan.plan_id  # a pull or fetch bringing them already
    src = min(
        trie.holders_of(last),
        key=lambda h: (
            ready(h, now) if ready is not None else 0.0,
            h.cp_degree != dest.cp_degree,
            h.slot,
        ),
    )
    moves = [
        BlockMove(
            z.block_id, z.depth, src.worker_id, src.device_of(z.depth), dest.device_of(z.depth)
        )
        for z in path[held:upto]
    ]
    plan = plans.start_copy("pull", dest, moves, score=0.0)
    return plan, plan.plan_id


def fetch(
    trie: PrefixTrie,
    plans: PlansInFlight,
    block_ids: Sequence[int],
    usable: int,
    held: int,
    dest: WorkerInfo,
) -> CopyPlan | None:
    """Missing blocks of a pending prefix at ``dest`` that this request would reuse
    (its first ``usable`` blocks, ``held`` of them held)."""
    moves = []
    parent = trie.nodes.get(block_ids[held - 1]) if held else None
    for depth in range(held, usable):
        node = trie.nodes.get(block_ids[depth])
        if node is None or node.parent is not parent or not node.pending:
            break
        if dest.slot not in node.pending or (node.block_id, dest.worker_id) in plans.copying:
            break
        retained = node.pending[dest.slot]
        if retained is not None:
            src_worker, src_device = None, retained
        elif node.holders:
            src = min(trie.holders_of(node), key=lambda h: (h.cp_degree != dest.cp_degree, h.slot))
            src_worker, src_device = src.worker_id, src.device_of(depth)
        else:
            _drop_pending_below(trie, dest, block_ids[depth:usable])
            break
        moves.append(BlockMove(node.block_id, depth, src_worker, src_device, dest.device_of(depth)))
        parent = node
    if not moves:
        return None
    return plans.start_copy("fetch", dest, moves, score=0.0)


def _drop_pending_below(trie: PrefixTrie, dest: WorkerInfo, block_ids: Sequence[int]) -> None:
    for bid in block_ids:
        below = trie.nodes.get(bid)
        if below is None or below.pending is None or dest.slot not in below.pending:
            break
        trie.clear_pending(below, dest.worker_id)


def reconcile(trie: PrefixTrie, plans: PlansInFlight, worker_id: int) -> list[CopyPlan]:
    """Fetch plans for every pending prefix of a new worker, right after its switch
    (most accessed first): a pending prefix is invisible to placement, so left to
    its first reuse it would be recomputed. A prefix that shares blocks with one
    planned before it fetches the rest only (its plan queues behind on the same
    devices)."""
    copying = plans.copying
    info = trie.worker(worker_id)
    out = []
    for leaf in handover.pending_leaves(trie, worker_id):
        path = leaf.path()
        held = trie.held_depth(path, info.slot)
        while held < len(path) and (path[held].block_id, worker_id) in copying:
            held += 1
        ids = [z.block_id for z in path]
        plan = fetch(trie, plans, ids, len(ids), held, info)
        if plan is not None:
            out.append(plan)
    return out


def by_hand(
    trie: PrefixTrie, plans: PlansInFlight, block_id: int, source: int, dest: int
) -> CopyPlan:
    """The prefix ending at ``block_id``, from worker ``source``, which holds it, to
    worker ``dest``, which does not (TrieError otherwise)."""
    node = trie.nodes.get(block_id)
    src, dst = trie.worker(source), trie.worker(dest)
    if node is None or not node.holders >> src.slot & 1:
        raise TrieError(f"worker {source} does not hold block {block_id:#x}")
    if node.holders >> dst.slot & 1:
        raise TrieError(f"worker {dest} already holds block {block_id:#x}")
    path = node.path()
    held = trie.held_depth(path, dst.slot)
    moves = [
        BlockMove(z.block_id, z.depth, source, src.device_of(z.depth), dst.device_of(z.depth))
        for z in path[held:]
    ]
    kind = "intra" if src.cp_degree == dst.cp_degree else "inter"
    return plans.start_copy(kind, dst, moves, score=0.0)
