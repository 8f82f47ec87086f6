"""The policy stack's parts, wired by ``PoolPolicy`` (``policy/pool_policy.py``, the
composition root): the state they share (``state.py``), the intents they return
(``intents.py``), and the parts, each built after the ones it holds: the copy lanes
(``lanes.py``), pulls (``pulls.py``), the open requests (``admission.py``), rank
failures (``outages.py``), the reshapes under way (``reshapes.py``) and the
workers' prefills (``prefills.py``). No part holds the stack or a callback into it.
"""
