"""Placement: every request to one worker. The workers' queues (``queues.py``), the
cost rule on them (``scheduler.py``), the baseline routers, the routers people run
today (``peers.py``) and the table of all of them by configuration name
(``routers.py``).

Imports the cache and the cost terms; never control (``tests/test_layout.py``).
"""
