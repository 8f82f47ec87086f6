"""vLLM decode instances fed by the prefill pool: ``VertumnusConnector``
(``connector.py``; needs vLLM) and what it decides and moves (``loads.py``)."""

from __future__ import annotations

from typing import Any


def __getattr__(name: str) -> Any:
    if name in ("VertumnusConnector", "VertumnusMetadata"):
        from vertumnus.integrations.vllm import connector

        return getattr(connector, name)
    raise AttributeError(name)
