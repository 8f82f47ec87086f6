"""A rank's compute time and the copy of its outputs to host memory.

Owns two things a rank does around each prefill, per device:

* ``StepTimer``: the prefill's compute time. On CUDA, events recorded on the rank's
  stream before and after it (the GPU's own time, not the host's view of a queue of
  launches); on CPU, the wall clock.
* ``HostStaging``: the outputs (logits, the hand-off's K/V, prompt log-probabilities)
  brought to host memory. On CUDA they are copied asynchronously into one pinned
  staging buffer (kept and grown to the largest step: pinning is slow, copying from
  pinned memory runs at the link's speed) and the host waits once, on an event
  after the last copy. The returned tensors are views of that buffer, valid until
  the next ``fetch``: the rank pickles them into its answer before it runs again.
  On CPU the tensors are already in host memory and returned as they are.
* ``keep_freed_host_memory``: on a CPU rank, glibc's allocator is told to keep freed
  memory for the next step instead of handing it back to the kernel, so activations
  reuse pages that are already mapped rather than fault in fresh zeroed ones.

Does not own what is sent (``messages.py``) or the prefill itself (``zigzag.py``).
"""

from __future__ import annotations

import ctypes
import math
import sys
import time

import torch
from torch import Tensor


class StepTimer:
    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self._start_s = 0.0
        self._events: tuple[torch.cuda.Event, torch.cuda.Event] | None = None

    def start(self) -> None:
        if self.cuda:
            begin = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            begin.record()
            self._events = (begin, end)
        else:
            self._start_s = time.perf_counter()

    def stop(self) -> float:
        """Seconds since ``start`` of this device's work (waits for it on CUDA)."""
        if self._events is None:
            return time.perf_counter() - self._start_s
        begin, end = self._events
        end.record()
        end.synchronize()
        self._events = None
        return float(begin.elapsed_time(end)) / 1e3


class HostStaging:
    ALIGN = 256  # bytes: each tensor's view starts aligned in the buffer

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self._buffer: Tensor | None = None  # pinned uint8, CUDA only

    def fetch(self, tensors: list[Tensor | None]) -> list[Tensor | None]:
        """Host copies of ``tensors`` (None stays None), same dtypes and shapes."""
        if not self.cuda:
            return [None if t is None else t.cpu() for t in tensors]
        offsets, end = [], 0
        for t in tensors:
            offsets.append(end)
            if t is not None:
                end += math.ceil(t.numel() * t.element_size() / self.ALIGN) * self.ALIGN
        if self._buffer is None or self._buffer.numel() < end:
            self._buffer = torch.empty(max(end, 1), dtype=torch.uint8, pin_memory=True)
        out: list[Tensor | None] = []
        for t, at in zip(tensors, offsets, strict=True):
            if t is None:
                out.append(None)
                continue
            size = t.numel() * t.element_size()
            view = self._buffer[at : at + size].view(t.dtype).view(t.shape)
            view.copy_(t, non_blocking=True)
            out.append(view)
        done = torch.cuda.Event()  # type: ignore[no-untyped-call]
        done.record()
        done.synchronize()
        return out


# mallopt parameters (glibc's malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_MAX = 32 << 20  # glibc's ceiling on 64-bit hosts


def keep_freed_host_memory() -> bool:
    """Make glibc's malloc keep freed memory in the process: blocks up to 32 MiB come
    from the heap rather than from their own ``mmap``, and the heap's top is never
    trimmed. True where glibc took both settings; False elsewhere (no glibc), where
    the allocator stays as it was.

    Why: a prefill allocates and frees the same few activation sizes every layer.
    By default glibc maps large blocks afresh and returns a freed heap top to the
    kernel, so each step page-faults its activations in again: on one core that was
    6-12 % of a bf16 prefill at 2-8K tokens (vLLM preloads tcmalloc for the same
    reason). The cost is that a rank's heap stays at its largest step's size.
    Weights and the KV store are single allocations above 32 MiB, mapped as before.
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except AttributeError:  # a libc without mallopt
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    trimmed = mallopt(M_TRIM_THRESHOLD, 2**31 - 1)
    mapped = mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX)
    return bool(trimmed and mapped)
