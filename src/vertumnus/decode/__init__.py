"""The decode side of the KV hand-off: the pull of a prompt's KV from the prefill
pool (``kv_pull``, ``kv_socket``, ``kv_stream``, ``dist_client``, ``kv_client``),
the prompt's KV as it arrived (``prompt_kv``), and the reference decode server
(``engine``, ``loop``, ``server``, ``keys``, ``handoff``, ``answers``,
``transfer``, ``timings``), and the sampling model both servers choose tokens by
(``sampling``; the pool's own first token, ``first_token``). The wire format both
sides speak is ``kv_wire``; the prefill side is ``runtime/kv/handoffs.py`` and
``server/handoff_routes.py``.

Imports ``protocol/`` (the dialect), ``http_json.py`` (the HTTP answers both
servers share), the engine and the configuration; never ``server/``, which imports
this package (the proxy, the first token)."""
