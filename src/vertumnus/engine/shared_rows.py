"""Shared-memory segments a rank writes a KV hand-off's blocks into, for the
coordinator on the same host to stream without the bytes crossing a pipe.

The coordinator creates and owns each segment (``multiprocessing.shared_memory``);
a rank attaches by name once and keeps it mapped (a few segments are reused for
every pull). The ranks are the coordinator's children and share its resource
tracker, so an attachment adds nothing to the tracker's books: the coordinator's
unlink is the one that counts.
"""

from __future__ import annotations

from collections import OrderedDict
from multiprocessing import shared_memory

import torch
from torch import Tensor

KEEP = 16  # segments kept mapped per rank


class Attached:
    """One rank's mapped segments, by name (the least recently used unmapped first)."""

    def __init__(self) -> None:
        self._maps: OrderedDict[str, shared_memory.SharedMemory] = OrderedDict()

    def view(self, name: str, dtype: torch.dtype, shape: tuple[int, ...]) -> Tensor:
        shm = self._maps.get(name)
        if shm is None:
            shm = shared_memory.SharedMemory(name=name)
            self._maps[name] = shm
            while len(self._maps) > KEEP:
                _, old = self._maps.popitem(last=False)
                old.close()
        self._maps.move_to_end(name)
        count = 1
        for n in shape:
            count *= n
        return torch.frombuffer(shm.buf, dtype=dtype, count=count).view(shape)

    def close(self) -> None:
        for shm in self._maps.values():
            shm.close()
        self._maps.clear()
