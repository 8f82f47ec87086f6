"""The prefix cache, as the policy sees it: the global trie, each worker's index of
its KV blocks, the manager's scan and its plans (replicate, reclaim, pull), the
hand-over of prefixes when workers split or merge, the ledger that turns plans into
slot moves, hand-off holds and the prefixes on their way.

Imports only the lattice and the cost terms beside it (``policy/costs.py``,
``policy/geometry.py``, ``policy/lattice.py``): never placement or control
(``tests/test_layout.py``).
"""
