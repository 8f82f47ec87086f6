"""The attention kernels (the CPU split merged by log-sum-exp, the chunked CPU kernel,
and the CUDA kernels' bottom-right bias and head expansion, run here on CPU) against
one masked softmax computed from scratch, and the choice among them."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from support.factories import TINY
from vertumnus.config import EngineConfig
from vertumnus.config.tables import ConfigError
from vertumnus.engine import attention
from vertumnus.engine.attention import (
    CPU_KERNELS,
    TUNE_MARGIN,
    choose_kernel,
    merge_by_lse,
    pick_cpu_kernel,
    prefix_causal_attention,
    run_kernel,
)
from vertumnus.engine.model import CausalLM
from vertumnus.engine.rank import _pick_attention, settle_cpu_attention


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int) -> torch.Tensor:
    """Explicit softmax(q k^T / sqrt(D) + bottom-right causal mask) v, in float64."""
    group = q.shape[1] // k.shape[1]
    k = k.double().repeat_interleave(group, dim=1)
    v = v.double().repeat_interleave(group, dim=1)
    scores = q.double() @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    n, total = q.shape[2], k.shape[2]
    visible = torch.arange(total)[None, :] <= (start + torch.arange(n))[:, None]
    scores = scores.masked_fill(~visible, float("-inf"))
    return (scores.softmax(-1) @ v).float()


@pytest.mark.parametrize("start", [0, 1, 5, 16, 100])
@pytest.mark.parametrize("n", [1, 3, 32])
@pytest.mark.parametrize(("hq", "hkv"), [(4, 4), (4, 2), (8, 1)])
def test_prefix_causal_attention_matches_masked_softmax(start: int, n: int, hq: int, hkv: int):
    gen = torch.Generator().manual_seed(start * 1000 + n * 10 + hq + hkv)
    q = torch.randn(1, hq, n, 16, generator=gen)
    k = torch.randn(1, hkv, start + n, 16, generator=gen)
    v = torch.randn(1, hkv, start + n, 16, generator=gen)
    out = prefix_causal_attention(q, k, v, start)
    assert out.shape == (1, hq, n, 16)
    torch.testing.assert_close(out, _reference(q, k, v, start), atol=1e-5, rtol=0)


def test_prefix_causal_attention_rejects_wrong_key_count():
    q = torch.zeros(1, 2, 4, 8)
    kv = torch.zeros(1, 2, 9, 8)
    with pytest.raises(ValueError, match="expected 10 keys for 4 queries at 6, got 9"):
        prefix_causal_attention(q, kv, kv, 6)


def test_merge_by_lse_equals_softmax_over_the_union():
    gen = torch.Generator().manual_seed(7)
    scores = torch.randn(1, 2, 3, 10, generator=gen) * 5
    values = torch.randn(1, 2, 10, 4, generator=gen)
    parts = [(scores[..., :6], values[:, :, :6]), (scores[..., 6:], values[:, :, 6:])]
    outs = [(s.softmax(-1) @ v, s.logsumexp(-1)) for s, v in parts]
    merged = merge_by_lse(outs[0][0], outs[0][1], outs[1][0], outs[1][1])
    torch.testing.assert_close(merged, scores.softmax(-1) @ values, atol=1e-6, rtol=0)


@pytest.mark.parametrize(
    "kernel", ["cpu-split", "cpu-chunked", "flash-lower-right", "efficient-lower-right"]
)
@pytest.mark.parametrize("start", [0, 7, 48])
@pytest.mark.parametrize(("hq", "hkv"), [(4, 4), (8, 2)])
def test_every_kernel_computes_bottom_right_causal_attention(
    kernel: str, start: int, hq: int, hkv: int
):
    """The CUDA kernels' arithmetic (CausalBias lower-right, GQA in-kernel or expanded
    heads) on CPU: SDPA runs it by its math kernel here, by flash or the
    memory-efficient kernel on a GPU. A top-left bias or a wrong head order fails."""
    if kernel == "cpu-split" and start == 0:
        kernel = "sdpa-causal"
    gen = torch.Generator().manual_seed(start + hq)
    n = 12
    q = torch.randn(1, hq, n, 16, generator=gen)
    k = torch.randn(1, hkv, start + n, 16, generator=gen)
    v = torch.randn(1, hkv, start + n, 16, generator=gen)
    out = run_kernel(kernel, q, k, v, start)
    torch.testing.assert_close(out, _reference(q, k, v, start), atol=1e-5, rtol=0)


def test_bf16_split_stays_within_bf16_rounding_of_the_exact_result():
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 8, s, 64, generator=gen) for s in (64, 160, 160))
    k, v = k[:, :2], v[:, :2]
    out = prefix_causal_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), 96)
    assert out.dtype == torch.bfloat16
    # Inputs rounded to bf16 (relative 2^-9) and the output rounded once more.
    torch.testing.assert_close(out.float(), _reference(q, k, v, 96), atol=2e-2, rtol=0)


@pytest.mark.parametrize("start", [0, 5, 40])
@pytest.mark.parametrize("n", [1, 7, 23])
@pytest.mark.parametrize(("hq", "hkv"), [(4, 4), (6, 2)])
def test_the_chunked_kernel_is_exact_across_many_blocks(
    start: int, n: int, hq: int, hkv: int, monkeypatch: pytest.MonkeyPatch
):
    """Blocks of 4 query rows: a last block shorter than the others, the diagonal mask
    of each block placed after the keys the block sees in full, GQA heads stacked."""
    monkeypatch.setattr(attention, "CHUNK_ROWS", 4)
    gen = torch.Generator().manual_seed(start + 10 * n + hq)
    q = torch.randn(1, hq, n, 16, generator=gen)
    k = torch.randn(1, hkv, start + n, 16, generator=gen)
    v = torch.randn(1, hkv, start + n, 16, generator=gen)
    out = prefix_causal_attention(q, k, v, start, cpu="chunked")
    assert out.shape == (1, hq, n, 16)
    torch.testing.assert_close(out, _reference(q, k, v, start), atol=1e-5, rtol=0)


def test_the_chunked_kernel_in_bf16_stays_within_bf16_rounding(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(attention, "CHUNK_ROWS", 16)
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 8, s, 64, generator=gen) for s in (64, 160, 160))
    k, v = k[:, :2], v[:, :2]
    out = prefix_causal_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), 96, cpu="chunked")
    assert out.dtype == torch.bfloat16
    # As the split's bound: inputs, scores and probabilities rounded to bf16.
    torch.testing.assert_close(out.float(), _reference(q, k, v, 96), atol=2e-2, rtol=0)


def test_a_named_cpu_kernel_is_taken_as_named_and_anything_else_refused():
    assert pick_cpu_kernel("flash", 4, 2, 16, torch.float32) == ("flash", {})
    assert pick_cpu_kernel("chunked", 4, 2, 16, torch.float32) == ("chunked", {})
    with pytest.raises(ValueError, match="cpu_attention must be auto or one of"):
        pick_cpu_kernel("fastest", 4, 2, 16, torch.float32)


def test_auto_picks_chunked_only_where_it_beat_flash_at_every_length_tried():
    lengths = (64, 128)
    choice, timed = pick_cpu_kernel("auto", 4, 2, 16, torch.float32, lengths, rounds=1)
    assert choice in CPU_KERNELS and timed
    tried = list(timed)
    assert tried == list(lengths[: len(tried)])  # in order, stopping at flash's first win
    won = [t["chunked"] <= (1 - TUNE_MARGIN) * t["flash"] for t in timed.values()]
    assert all(0 < s < float("inf") for t in timed.values() for s in t.values())
    if choice == "chunked":
        assert tried == list(lengths) and all(won)
    else:
        assert won == [True] * (len(won) - 1) + [False]


def test_the_kernel_choice_never_masks_densely():
    assert choose_kernel("cpu", 0, flash_ok=False) == "sdpa-causal"
    assert choose_kernel("cpu", 16, flash_ok=False) == "cpu-split"
    assert choose_kernel("cpu", 0, flash_ok=False, cpu="chunked") == "cpu-chunked"
    assert choose_kernel("cpu", 16, flash_ok=False, cpu="chunked") == "cpu-chunked"
    # A GPU chooses per call whatever the CPU family says.
    assert choose_kernel("cuda", 16, flash_ok=True, cpu="chunked") == "flash-lower-right"
    assert choose_kernel("cuda", 16, flash_ok=True) == "flash-lower-right"
    assert choose_kernel("cuda", 0, flash_ok=True) == "flash-lower-right"
    # fp32 on CUDA: no flash; the memory-efficient kernel, with expanded KV heads.
    assert choose_kernel("cuda", 16, flash_ok=False) == "efficient-lower-right"
    assert choose_kernel("cuda", 0, flash_ok=False) == "efficient-lower-right"
    with pytest.raises(ValueError, match="unknown attention kernel 'masked'"):
        run_kernel(
            "masked", torch.zeros(1, 1, 1, 8), torch.zeros(1, 1, 1, 8), torch.zeros(1, 1, 1, 8), 0
        )
    with pytest.raises(ValueError, match="without a visible prefix"):
        run_kernel(
            "sdpa-causal",
            torch.zeros(1, 1, 1, 8),
            torch.zeros(1, 1, 3, 8),
            torch.zeros(1, 1, 3, 8),
            2,
        )


def test_the_engine_config_refuses_an_unknown_cpu_attention() -> None:
    assert EngineConfig().cpu_attention == "auto"
    assert EngineConfig(cpu_attention="chunked").cpu_attention == "chunked"
    with pytest.raises(ConfigError, match="cpu_attention must be auto, flash or chunked, got 'x'"):
        EngineConfig(cpu_attention="x")


def test_a_cpu_rank_sets_the_kernel_it_picked_on_its_model(
    tiny_model: CausalLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tiny_model, "cpu_attention", "flash")
    named = EngineConfig(device="cpu", dtype="float32", cpu_attention="chunked")
    assert _pick_attention(tiny_model, named, 1) == "chunked"
    assert tiny_model.cpu_attention == "chunked"
    auto = EngineConfig(device="cpu", dtype="float32", threads_per_rank=1)
    picked = _pick_attention(tiny_model, auto, 1)
    assert picked in CPU_KERNELS and tiny_model.cpu_attention == picked


def test_auto_is_settled_once_for_a_hosts_ranks_and_a_named_kernel_kept() -> None:
    threads = torch.get_num_threads()
    named = EngineConfig(device="cpu", cpu_attention="flash")
    assert settle_cpu_attention(TINY, named, 2) == (named, {})
    if not torch.cuda.is_available():  # a GPU asked for and absent: the ranks refuse it
        gpu = EngineConfig(device="cuda")
        assert settle_cpu_attention(TINY, gpu, 2) == (gpu, {})
    auto = EngineConfig(device="cpu", dtype="float32", threads_per_rank=1)
    settled, timed = settle_cpu_attention(TINY, auto, 2)
    assert settled.cpu_attention in CPU_KERNELS and 2048 in timed
    assert settled == dataclasses.replace(auto, cpu_attention=settled.cpu_attention)
    assert torch.get_num_threads() == threads  # timed on one rank's threads, then restored


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("start", "key_start", "n", "window", "sinks"),
    [
        (0, 0, 300, 40, False),  # the band's edge inside every block
        (200, 150, 70, 51, True),  # keys clipped: the window reaches before them
        (90, 0, 260, 300, False),  # a window longer than the sequence
        (37, 0, 129, None, True),  # sinks alone, full causal attention with a prefix
        (0, 0, 5, 1, True),  # a query sees only itself
    ],
)
def test_window_flash_equals_the_banded_math(
    dtype: torch.dtype, start: int, key_start: int, n: int, window: int | None, sinks: bool
) -> None:
    """The fused-kernel window attention (per block of queries, a causal flash call
    over the block and one over the window's reach, reversed, merged by log-sum-exp)
    computes what the banded math kernel computes."""
    gen = torch.Generator().manual_seed(n)
    keys = start + n - key_start
    q = torch.randn(1, 4, n, 16, generator=gen).to(dtype)
    k = torch.randn(1, 2, keys, 16, generator=gen).to(dtype)
    v = torch.randn(1, 2, keys, 16, generator=gen).to(dtype)
    s = torch.randn(4, generator=gen) if sinks else None
    got = attention.window_flash(q, k, v, start, key_start, window, s)
    want = attention.banded_attention(
        q.double(), k.double(), v.double(), start, key_start, window, s
    )
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.double(), want, rtol=0, atol=tol)
