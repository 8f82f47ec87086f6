"""The host link's measurement (``runtime/host_link.py``): what ``profile`` writes into
a profile's ``host_link`` for the host KV tier's prices."""

from __future__ import annotations

import math
from multiprocessing.shared_memory import SharedMemory

import pytest
import torch

from vertumnus.config import EngineConfig, resolve_model
from vertumnus.runtime import host_link
from vertumnus.runtime.host_link import measure_host_link

TINY, _ = resolve_model("tiny")
SMALL = {"total_bytes": 1 << 20, "repeats": 2}  # 32 blocks of the tiny model in fp32


def test_the_tiny_model_on_the_cpu_gets_positive_bandwidths_and_its_kv_bytes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    made: list[str] = []

    class Recorded(SharedMemory):
        def __init__(self, *args: object, **kwargs: object) -> None:
            super().__init__(*args, **kwargs)  # type: ignore[arg-type]
            made.append(self.name)

    monkeypatch.setattr(host_link, "SharedMemory", Recorded)
    link = measure_host_link(TINY, EngineConfig(device="cpu", dtype="float32"), **SMALL)
    assert set(link) == {"kv_bytes_per_token", "d2h_bytes_s", "h2d_bytes_s", "source"}
    # fp32 on the CPU: 4 layers x (K, V) x 2 KV heads x head dim 32 x 4 bytes.
    assert link["kv_bytes_per_token"] == 4 * 2 * 2 * 32 * 4 == TINY.kv_bytes(4) == 2048
    for name in ("d2h_bytes_s", "h2d_bytes_s"):
        assert isinstance(link[name], float) and math.isfinite(link[name]) and link[name] > 0
    assert link["source"].startswith("measured by `profile` on cpu-")
    # The store and the tier were shared-memory segments, both gone afterwards.
    assert len(made) == 2
    for name in made:
        with pytest.raises(FileNotFoundError):
            SharedMemory(name=name)


def test_the_kv_dtype_is_the_ranks_one() -> None:
    link = measure_host_link(TINY, EngineConfig(device="cpu", dtype="bfloat16"), **SMALL)
    assert link["kv_bytes_per_token"] == TINY.kv_bytes(2) == 1024


def test_the_timed_copies_move_every_block_both_ways() -> None:
    """Demoting puts store slot order[i] in tier slot i (K, then V); loading back
    restores the store: the bytes counted are the bytes moved."""
    shape = (5, 2, 4, 2, 3)  # blocks, layers, block size, KV heads, head dim
    k, v = torch.randn(shape), torch.randn(shape)
    want_k, want_v = k.clone(), v.clone()
    tier = torch.zeros(shape[0], 2, *shape[1:])
    order = [3, 0, 4, 1, 2]
    d2h, h2d = host_link._moves(k, v, tier, order, non_blocking=False)
    d2h()
    for i, slot in enumerate(order):
        assert torch.equal(tier[i, 0], want_k[slot]) and torch.equal(tier[i, 1], want_v[slot])
    k.zero_()
    v.zero_()
    h2d()
    assert torch.equal(k, want_k) and torch.equal(v, want_v)


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="repeats and total_bytes"):
        measure_host_link(TINY, EngineConfig(device="cpu"), repeats=0)
