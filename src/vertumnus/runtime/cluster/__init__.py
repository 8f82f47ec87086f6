"""Ranks on other hosts, as Ray actors: ``RayRanks`` (``ray_ranks.py``), the hosts'
nodes and placement groups (``ray_hosts.py``), the actor itself (``rank_actor.py``)
and the check that the cluster admits only holders of its token (``auth.py``).
Ray is imported only here, and only when a pool has a ``[cluster]`` table."""
