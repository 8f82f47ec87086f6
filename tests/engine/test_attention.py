"""The attention kernels (the CPU split merged by log-sum-exp, and the CUDA kernels'
bottom-right bias and head expansion, run here on CPU) against one masked softmax
computed from scratch, and the choice among them."""

from __future__ import annotations

import math

import pytest
import torch

from vertumnus.engine.attention import (
    choose_kernel,
    merge_by_lse,
    prefix_causal_attention,
    run_kernel,
)


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


@pytest.mark.parametrize("kernel", ["cpu-split", "flash-lower-right", "efficient-lower-right"])
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


def test_the_kernel_choice_never_masks_densely():
    assert choose_kernel("cpu", 0, flash_ok=False) == "sdpa-causal"
    assert choose_kernel("cpu", 16, flash_ok=False) == "cpu-split"
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
