"""A rank's step timer and the staging of its outputs to host memory, on CPU (the
CUDA path, pinned buffers and events, runs in tools/device_check.sh)."""

from __future__ import annotations

import time

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
