"""The decode side of the KV hand-off: the pull of a prompt's KV from the prefill
pool (``kv_pull``, ``kv_socket``, ``kv_stream``, ``dist_client``, ``kv_client``),
the prompt's KV as it arrived (``prompt_kv``), and the reference decode server
(``engine``, ``loop``, ``server``, ``keys``, ``handoff``, ``answers``,
``completion``, ``sampling``). The wire format both sides speak is ``kv_wire``; the
prefill side is ``runtime/kv/handoffs.py`` and ``server/handoff_routes.py``."""
