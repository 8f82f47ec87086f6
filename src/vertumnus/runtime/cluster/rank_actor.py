"""One rank of a multi-host pool, as a Ray actor.

Owns nothing but the adapter: the actor starts its rank with the same code as a
local rank process (``engine/rank.py``'s ``open_rank``) and executes each command
with the same ``RankState.handle``, in the order the coordinator sent them (one
caller, and one thread for them: Ray runs an actor's calls in submission order).
Commands arrive pickled (the coordinator pickles a prefill's command once for all
its ranks) and each answer is returned pickled, as a local rank writes it on its
pipe, so the coordinator hands the bytes to its answer pipe without reading them. ``alive`` never
returns: the coordinator keeps one call of it pending, in a group of its own, and
Ray fails that call when the actor, its process or its node dies: the rank's
sentinel. Collectives and KV copies go rank to rank over torch.distributed, as
between local ranks.
"""

from __future__ import annotations

import os
import pickle
import threading
import traceback

from vertumnus.engine.messages import RankFailed
from vertumnus.engine.rank import RankSpec, open_rank
from vertumnus.engine.rank_state import RankState

WATCH_GROUP = "watch"  # the concurrency group of ``alive`` and ``pid``


def _pickled(answer: object) -> bytes:
    return pickle.dumps(answer, protocol=pickle.HIGHEST_PROTOCOL)


class RankActor:
    """Wrapped by ``ray.remote`` in ``ray_ranks.py`` (with the ``watch`` group); its
    methods run in the actor's process."""

    def __init__(self) -> None:
        self._state: RankState | None = None
        self._rank: int | None = None

    def start(self, rank: int, spec: RankSpec) -> bytes:
        """Start the rank: its pickled ``RankReady``, or ``RankFailed`` saying why not."""
        self._rank = rank
        try:
            self._state, ready = open_rank(rank, spec)
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
            return _pickled(RankFailed(rank, None, error, traceback.format_exc()))
        return _pickled(ready)

    def handle(self, command: bytes) -> bytes | None:
        """The pickled answer to the pickled ``command`` (None: ``Shutdown``, no answer).
        (Only the coordinator reaches this actor: Ray admits only token holders.)"""
        msg = pickle.loads(command)
        if self._state is None:
            error = f"{type(msg).__name__} before the rank started"
            return _pickled(RankFailed(self._rank or 0, None, error, ""))
        answer = self._state.handle(msg)
        return None if answer is None else _pickled(answer)

    def alive(self) -> None:
        """Never returns (see the module docstring)."""
        threading.Event().wait()

    def pid(self) -> int:
        return os.getpid()
