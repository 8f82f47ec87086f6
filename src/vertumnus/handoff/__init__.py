"""The KV hand-off to a decode pool: the wire format (``wire``), the prefill side's
leases and pull endpoint (``runtime/handoff.py``, ``server/``), and the reference
decode server (``decode``)."""
