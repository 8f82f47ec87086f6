"""The prefill side's KV outside a prefill: hand-offs to a decode server and their
leases (``handoffs.py``, ``leases.py``), a pull's stream (``stream.py``), the
shared-memory segments a pull streams from (``segments.py``), KV read back from the
ranks (``reads.py``), the cache manager's copies rank to rank (``copies.py``) and the
host tier's blocks in this host's shared memory (``host_tier.py``)."""
