"""The global prefix trie: which worker holds which prefix, and per-degree demand.

One node per cache block, keyed by its block id. Block ids are chained hashes (the
engine's ``blocks.block_id`` or a trace's ``hash_ids``), so an id names its whole
prefix and a node needs no child table, only its parent and a child count.

Its records, ``Node`` (a block's holders, pending marks and statistics) and
``WorkerInfo`` (a worker's slot), are in ``nodes`` with their fields' meaning.

Invariants (``check``):
  * holders are prefix-closed: a worker holding a node holds its parent;
  * ``replicated`` = nodes with >= 2 holders of one degree; ``touched`` = nodes with
    statistics; per-worker node sets agree with the holder bits;
  * a node with no holder, no pending mark, no statistics and no children is gone.

Pure Python, clock-free. Not owned here: the statistics' meaning and the scan
(``cache/manager.py``), the physical blocks (each worker's ``WorkerCacheIndex``).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from vertumnus.blocks import ROOT_BLOCK_ID
from vertumnus.policy.cache.nodes import Node, TrieError, WorkerInfo, bits

__all__ = ["PrefixTrie"]


class PrefixTrie:
    def __init__(self, degrees: Sequence[int], block_tokens: int) -> None:
        if not degrees or min(degrees) < 1 or len(set(degrees)) != len(degrees):
            raise TrieError(f"degrees must be distinct positive integers, got {degrees}")
        if block_tokens < 1:
            raise TrieError(f"block_tokens must be >= 1, got {block_tokens}")
        self.degrees = tuple(sorted(degrees))
        self.degree_index = {c: k for k, c in enumerate(self.degrees)}
        self.block_tokens = block_tokens
        self.nodes: dict[int, Node] = {}
        self.workers: dict[int, WorkerInfo] = {}
        self.by_slot: dict[int, WorkerInfo] = {}
        self.degree_mask = [0] * len(self.degrees)  # holder bits of each degree's workers
        self.worker_nodes: dict[int, set[Node]] = {}  # worker id -> nodes it holds
        self.worker_pending: dict[int, set[Node]] = {}  # worker id -> its pending nodes
        self.replicated: set[Node] = set()
        self.touched: set[Node] = set()
        self._free_slots: list[int] = []

    # -- workers ---------------------------------------------------------------------

    def add_worker(self, worker_id: int, cp_degree: int, first_device: int) -> WorkerInfo:
        if worker_id in self.workers:
            raise TrieError(f"worker {worker_id} is already registered")
        if cp_degree not in self.degree_index:
            raise TrieError(f"worker {worker_id}: degree {cp_degree} not in {self.degrees}")
        slot = self._free_slots.pop() if self._free_slots else len(self.by_slot)
        info = WorkerInfo(worker_id, cp_degree, first_device, slot)
        self.workers[worker_id] = self.by_slot[slot] = info
        self.degree_mask[self.degree_index[cp_degree]] |= 1 << slot
        self.worker_nodes[worker_id] = set()
        self.worker_pending[worker_id] = set()
        return info

    def remove_worker(self, worker_id: int) -> None:
        """Forget a worker: its holder bits and pending marks go, its slot is reused."""
        info = self.worker(worker_id)
        held = sorted(self.worker_nodes.pop(worker_id), key=lambda n: -n.depth)
        for node in held:
            node.holders &= ~(1 << info.slot)
            self._holders_changed(node)
        for node in sorted(self.worker_pending.pop(worker_id), key=lambda n: -n.depth):
            self._drop_pending(node, info.slot)
        self.degree_mask[self.degree_index[info.cp_degree]] &= ~(1 << info.slot)
        del self.workers[worker_id], self.by_slot[info.slot]
        self._free_slots.append(info.slot)
        for node in held:  # deepest first: a pruned child frees its parent
            self.prune(node)

    def worker(self, worker_id: int) -> WorkerInfo:
        try:
            return self.workers[worker_id]
        except KeyError:
            raise TrieError(f"unknown worker {worker_id}") from None

    # -- holders, from cache reports -------------------------------------------------

    def insert_chain(self, worker_id: int, parent_id: int, block_ids: Sequence[int]) -> None:
        """``worker_id`` now holds ``block_ids``, a chain under ``parent_id``."""
        info = self.worker(worker_id)
        bit = 1 << info.slot
        parent = None if parent_id == ROOT_BLOCK_ID else self.nodes.get(parent_id)
        if parent_id != ROOT_BLOCK_ID and (parent is None or not parent.holders & bit):
            raise TrieError(
                f"worker {worker_id} reports blocks under {parent_id:#x}, a prefix it does not hold"
            )
        mine = self.worker_nodes[worker_id]
        for bid in block_ids:
            node = self.nodes.get(bid)
            if node is None:
                node = Node(bid, parent, 0 if parent is None else parent.depth + 1)
                self.nodes[bid] = node
                if parent is not None:
                    parent.num_children += 1
            elif node.parent is not parent:
                raise TrieError(f"block {bid:#x} reported under a different parent")
            if not node.holders & bit:
                node.holders |= bit
                mine.add(node)
                self._holders_changed(node)
            parent = node

    def evict(self, worker_id: int, block_id: int) -> None:
        """``worker_id`` no longer holds ``block_id`` (a leaf of its cache)."""
        info = self.worker(worker_id)
        node = self.nodes.get(block_id)
        if node is None or not node.holders & (1 << info.slot):
            return  # already gone: evictions may repeat what a merge or removal did
        node.holders &= ~(1 << info.slot)
        self.worker_nodes[worker_id].discard(node)
        self._holders_changed(node)
        self.prune(node)

    def _holders_changed(self, node: Node) -> None:
        if any((node.holders & m).bit_count() >= 2 for m in self.degree_mask):
            self.replicated.add(node)
        else:
            self.replicated.discard(node)

    # -- queries ---------------------------------------------------------------------

    def match(self, block_ids: Sequence[int], max_blocks: int) -> list[Node]:
        """MatchedPath: the longest prefix of ``block_ids[:max_blocks]`` held anywhere."""
        out: list[Node] = []
        nodes, parent = self.nodes, None
        for bid in block_ids[:max_blocks]:
            node = nodes.get(bid)
            if node is None or not node.holders or node.parent is not parent:
                break
            out.append(node)
            parent = node
        return out

    def prefix_tokens(self, node: Node) -> int:
        """Tokens of the prefix ending at ``node``."""
        return (node.depth + 1) * self.block_tokens

    def reused_path(self, path: Sequence[Node], worker_id: int) -> Sequence[Node]:
        """ReusedPath: the leading part of ``path`` (a MatchedPath) that a worker holds."""
        return path[: self.held_depth(path, self.worker(worker_id).slot)]

    def held_depth(self, path: Sequence[Node], slot: int) -> int:
        """How many leading nodes of ``path`` the worker in ``slot`` holds."""
        bit = 1 << slot
        n = 0
        for node in path:
            if not node.holders & bit:
                break
            n += 1
        return n

    def match_with_reuse(
        self, block_ids: Sequence[int], max_blocks: int
    ) -> tuple[list[Node], dict[int, int]]:
        """MatchedPath (as ``match``) and, for every worker holding part of it, how many
        leading nodes it holds. Holders only shrink along a path (and mostly stay the
        same), so one walk over the bit sets finds every worker's depth."""
        nodes, by_slot = self.nodes, self.by_slot
        path: list[Node] = []
        depth_of: dict[int, int] = {}
        parent, held = None, 0
        get = nodes.get
        for bid in block_ids[:max_blocks]:
            node = get(bid)
            if node is None or node.parent is not parent:
                break
            holders = node.holders
            if not holders:
                break
            if holders != held and path:
                for slot in bits(held & ~holders):
                    depth_of[by_slot[slot].worker_id] = len(path)
            held = holders
            path.append(node)
            parent = node
        for slot in bits(held):
            depth_of[by_slot[slot].worker_id] = len(path)
        return path, depth_of

    def replica_count(self, node: Node, cp_degree: int) -> int:
        return (node.holders & self.degree_mask[self.degree_index[cp_degree]]).bit_count()

    def holders_of(self, node: Node) -> Iterator[WorkerInfo]:
        for slot in bits(node.holders):
            yield self.by_slot[slot]

    # -- pending marks (reconfiguration) ---------------------------------------------

    def set_pending(self, node: Node, worker_id: int, retained_device: int | None) -> None:
        """``worker_id`` inherited the prefix to ``node``; ``retained_device`` still has
        the block's KV from the old geometry (None: nowhere known)."""
        slot = self.worker(worker_id).slot
        if node.pending is None:
            node.pending = {}
        node.pending[slot] = retained_device
        self.worker_pending[worker_id].add(node)

    def clear_pending(self, node: Node, worker_id: int) -> None:
        self._drop_pending(node, self.worker(worker_id).slot)
        self.worker_pending[worker_id].discard(node)
        self.prune(node)

    def _drop_pending(self, node: Node, slot: int) -> None:
        if node.pending is not None and slot in node.pending:
            del node.pending[slot]
            if not node.pending:
                node.pending = None
            self.prune(node)

    # -- statistics ------------------------------------------------------------------

    def add_access(self, node: Node, k: int, amount: float) -> None:
        if node.access is None:
            node.access = [0.0] * len(self.degrees)
            self.touched.add(node)
        node.access[k] += amount

    def add_missed(self, node: Node, k: int, amount: float) -> None:
        if node.missed is None:
            node.missed = [0.0] * len(self.degrees)
            self.touched.add(node)
        node.missed[k] += amount

    def decay(self, factor: float, floor: float) -> None:
        """Multiply every statistic by ``factor``; drop those that fall below ``floor``."""
        emptied = []
        for node in self.touched:
            access, missed = node.access, node.missed
            if access is not None:
                access = [v * factor for v in access]
                node.access = access if max(access) >= floor else None
            if missed is not None:
                missed = [v * factor for v in missed]
                node.missed = missed if max(missed) >= floor else None
            if node.access is None and node.missed is None:
                emptied.append(node)
        for node in emptied:
            self.touched.discard(node)
            self.prune(node)

    # -- pruning ---------------------------------------------------------------------

    def prune(self, node: Node | None) -> None:
        """Remove ``node`` and its ancestors while nothing keeps them."""
        while (
            node is not None
            and not node.holders
            and node.num_children == 0
            and node.pending is None
            and node.access is None
            and node.missed is None
            and self.nodes.get(node.block_id) is node
        ):
            del self.nodes[node.block_id]
            self.replicated.discard(node)
            parent = node.parent
            if parent is not None:
                parent.num_children -= 1
            node = parent

    # -- invariants ------------------------------------------------------------------

    def check(self) -> None:
        """Raise AssertionError if a structural invariant of the module docstring fails."""
        children: dict[int, int] = {}
        per_worker: dict[int, set[Node]] = {w: set() for w in self.workers}
        all_bits = 0
        for info in self.workers.values():
            all_bits |= 1 << info.slot
        for bid, node in self.nodes.items():
            assert node.block_id == bid
            if node.parent is not None:
                assert self.nodes.get(node.parent.block_id) is node.parent, "orphaned node"
                assert node.depth == node.parent.depth + 1
                children[node.parent.block_id] = children.get(node.parent.block_id, 0) + 1
                assert node.holders & ~node.parent.holders == 0, "held without its parent"
            else:
                assert node.depth == 0
            assert node.holders & ~all_bits == 0, "holder bit of an unknown worker"
            for slot in bits(node.holders):
                per_worker[self.by_slot[slot].worker_id].add(node)
            is_rep = any((node.holders & m).bit_count() >= 2 for m in self.degree_mask)
            assert is_rep == (node in self.replicated), "replicated set out of date"
            has_stats = node.access is not None or node.missed is not None
            assert has_stats == (node in self.touched), "touched set out of date"
            assert node.pending is None or node.pending, "empty pending table kept"
            for slot in node.pending or ():
                assert node in self.worker_pending[self.by_slot[slot].worker_id]
        for bid, node in self.nodes.items():
            assert node.num_children == children.get(bid, 0), "child count out of date"
            kept = node.holders or node.num_children or node.pending or node in self.touched
            assert kept, "an empty node was not pruned"
        assert self.replicated <= set(self.nodes.values())
        assert self.touched <= set(self.nodes.values())
        assert per_worker == self.worker_nodes, "per-worker node sets out of date"
        for worker_id, pending in self.worker_pending.items():
            slot = self.workers[worker_id].slot
            assert all(n.pending is not None and slot in n.pending for n in pending)
        for info in self.workers.values():
            k = self.degree_index[info.cp_degree]
            assert self.degree_mask[k] >> info.slot & 1
