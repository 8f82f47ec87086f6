"""A rank's step timer and the staging of its outputs to host memory, on CPU (the
CUDA path, pinned buffers and events, runs in tools/device_check.sh)."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
import torch

from vertumnus.engine.host_copy import HostStaging, StepTimer

CPU = torch.device("cpu")


def test_the_step_timer_measures_the_work_between_start_and_stop():
    timer = StepTimer(CPU)
    timer.start()
    time.sleep(0.02)
    assert timer.stop() >= 0.02


def test_cpu_outputs_reach_the_host_unchanged_and_none_stays_none():
    logits = torch.randn(1, 7)
    kv = torch.randn(2, 3, 5, 2, 4, dtype=torch.bfloat16)[:, :, 1:]  # not contiguous
    staged = HostStaging(CPU).fetch([logits, None, kv])
    assert staged[1] is None
    assert staged[0] is not None and staged[2] is not None
    assert torch.equal(staged[0], logits) and staged[0].dtype == torch.float32
    assert torch.equal(staged[2], kv) and staged[2].dtype == torch.bfloat16


# Runs in a fresh process (mallopt changes the whole process): allocates one 16 MiB
# block and reports what glibc's mallinfo2 saw.
MALLOC_PROBE = """
import ctypes, json, sys
from vertumnus.engine.host_copy import keep_freed_host_memory
class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in (
        "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost"
    ).split()]
libc = ctypes.CDLL(None)
if not hasattr(libc, "mallinfo2"):
    print(json.dumps(None)); sys.exit()
libc.mallinfo2.restype = MallInfo2
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
applied = keep_freed_host_memory() if sys.argv[1] == "kept" else None
before = libc.mallinfo2()
block = libc.malloc(16 << 20)
during = libc.mallinfo2()
libc.free(block)
after = libc.mallinfo2()
print(json.dumps({"applied": applied, "mapped": during.hblkhd - before.hblkhd,
                  "heap_before": before.arena, "heap_after_free": after.arena}))
"""


def _malloc_probe(mode: str) -> dict[str, int]:
    out = subprocess.run(
        [sys.executable, "-c", MALLOC_PROBE, mode],
        capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    if seen is None:
        pytest.skip("this libc has no mallinfo2 (glibc before 2.33, or not glibc)")
    return dict(seen)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator")
def test_a_cpu_rank_keeps_freed_activation_memory_instead_of_remapping_it():
    default = _malloc_probe("default")
    # Without the setting glibc maps a 16 MiB block by itself (and unmaps it on free):
    # the contrast that makes the next assertions mean something.
    assert default["mapped"] >= 16 << 20
    kept = _malloc_probe("kept")
    assert kept["applied"] is True
    assert kept["mapped"] == 0  # from the heap
    assert kept["heap_after_free"] >= kept["heap_before"] + (16 << 20)  # not trimmed
