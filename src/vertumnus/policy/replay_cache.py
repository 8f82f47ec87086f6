"""The workers' prefix caches as a replay fills them (the replay's cache model).

A request leaves its prompt cached on the worker that ran it, under its *leaf*
(the id of its last whole block); a later request whose prefix matched in the trie
ends at that leaf (its *link*: a conversation's next turn, an agent's next step)
reuses it where, and only where, the replay put the earlier one. So the replay
prices what a composition does to reuse: a pool of more, smaller workers scatters
a conversation's turns by load and keeps fewer long contexts per worker.

Each worker holds at most its KV capacity in tokens (``cp_degree`` times the
tokens one rank caches, over the replay's dilation); an entry counts the tokens
its request wrote (its input less what it reused), and the least recently used
entries go first when a new one does not fit, as the workers' indexes evict.

Requests whose link no replayed request left (their prefix was cached before the
forecast began, or is a shared prompt no single request ends at) keep the holders
the trie reported at their arrival: ``replay`` prices those as before.

Pure Python. Not owned here: the replay's queues and the cost rule (``replay``).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Mapping


class ReplayCache:
    """Prefixes left by replayed requests: leaf id -> the workers that hold it."""

    __slots__ = ("_capacity", "_entries", "_left", "_used", "_where")

    def __init__(self, capacity_tokens: Mapping[int, float] | None) -> None:
        """``capacity_tokens``: per worker, the tokens it can cache (None: without
        limit). A worker missing from it caches nothing."""
        self._capacity = capacity_tokens
        self._entries: dict[int, OrderedDict[int, float]] = {}  # leaf -> tokens
        self._used: dict[int, float] = {}
        self._where: dict[int, list[int]] = {}
        self._left: set[int] = set()  # every leaf stored, held still or evicted

    def holders(self, link: int) -> list[int] | None:
        """The workers holding the prefix that ends at block ``link`` (empty: a
        replayed request left it and it was evicted everywhere; None: none left it,
        so what the request found at its arrival stands)."""
        if not link or link not in self._left:
            return None
        return self._where.get(link, [])

    def store(self, worker_id: int, link: int, leaf: int, new_tokens: float) -> None:
        """A request ran on ``worker_id``: its reused prefix (``link``) was used now,
        and its prompt (``leaf``, ``new_tokens`` written) is cached there."""
        if not leaf:
            return
        limit = math.inf if self._capacity is None else self._capacity.get(worker_id, 0.0)
        if limit <= 0:
            return
        entries = self._entries.get(worker_id)
        if entries is None:
            entries = self._entries[worker_id] = OrderedDict()
            self._used[worker_id] = 0.0
        if link in entries:
            entries.move_to_end(link)
        if leaf in entries:
            entries.move_to_end(leaf)
            return
        size = max(new_tokens, 0.0)
        entries[leaf] = size
        self._left.add(leaf)
        self._where.setdefault(leaf, []).append(worker_id)
        used = self._used[worker_id] + size
        while used > limit and len(entries) > 1:
            key, freed = entries.popitem(last=False)
            used -= freed
            where = self._where[key]
            where.remove(worker_id)
            if not where:
                del self._where[key]
        self._used[worker_id] = used
