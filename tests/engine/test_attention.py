"""The split attention kernel (visible part + causal diagonal, merged by log-sum-exp)
against one masked softmax computed from scratch."""

from __future__ import annotations

import math

import pytest
import torch

from vertumnus.engine.attention import merge_by_lse, prefix_causal_attention


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
