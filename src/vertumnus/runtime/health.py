"""Whether the pool serves: the one record of it that the coordinator's parts share.

``ready``: the ranks started and admission is open (``stop_admission`` and a rank
pool that failed close it); ``failure``: why the pool cannot serve, when it cannot
(a rank pool that failed, a worker that could not be restarted, the shutdown);
``cluster_error``: why the Ray cluster of a multi-host pool does not answer, while
it does not; ``draining``: admission is closed for the shutdown, and what was accepted finishes:
a worker lost now is not restarted; ``stopping``: the server is closing, so nothing
new begins (set from the event loop, read from the decision thread as well).
"""

from __future__ import annotations

import threading


class Health:
    def __init__(self) -> None:
        self.ready = False
        self.failure: str | None = None
        self.cluster_error: str | None = None
        self.draining = False
        self._stopping = threading.Event()

    @property
    def stopping(self) -> bool:
        return self._stopping.is_set()

    def stop(self) -> None:
        """The server closes: admission ends and nothing new begins."""
        self.ready = False
        self.draining = True
        self._stopping.set()
