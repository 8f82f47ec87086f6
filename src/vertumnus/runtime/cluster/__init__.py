"""Ranks under node agents on other hosts: ``ClusterRanks`` (``ranks.py``), the hub the
agents connect to (``hub.py``) and its roster of them (``roster.py``), the node agent
(``agent.py``) and the signed and encrypted control channel between them
(``channel.py``)."""
