"""Attention of a block of queries over a prefix of keys, bottom-right causal.

Owns the kernel choice for the one attention shape the zigzag engine needs: queries
at key positions ``[start, start + n)`` attend to keys ``[0, start + n)``, i.e. to a
fully visible part ``[0, start)`` (cached prefix and earlier suffix chunks) and
causally to their own block ``[start, start + n)``.

Why split: fused kernels skip the masked half only for the plain, top-left aligned
causal mask. A boolean bottom-right mask makes them compute every block, which for
zigzag rank C-1 (and for any prefix) wastes up to half the attention work and
unbalances the ranks. So on CPU the visible part and the causal diagonal are two
fused calls whose results are merged exactly by their log-sum-exp. Elsewhere (CUDA)
the masked SDPA call is used until the split is measured there.

Shapes: q [1, Hq, n, D]; k, v [1, Hkv, start + n, D] (GQA: Hq a multiple of Hkv).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

# Fused CPU flash attention that also returns the log-sum-exp (GQA-aware).
_flash_cpu = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def prefix_causal_attention(q: Tensor, k: Tensor, v: Tensor, start: int) -> Tensor:
    """Queries at positions ``start + i`` see keys ``0 .. start + i``; returns [1, Hq, n, D]."""
    n = q.shape[2]
    if k.shape[2] != start + n:
        raise ValueError(f"expected {start + n} keys for {n} queries at {start}, got {k.shape[2]}")
    if start == 0:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    if q.device.type == "cpu" and _flash_cpu is not None:
        seen_o, seen_lse = _flash_cpu(q, k[:, :, :start], v[:, :, :start], 0.0, False)
        diag_o, diag_lse = _flash_cpu(q, k[:, :, start:], v[:, :, start:], 0.0, True)
        return merge_by_lse(seen_o, seen_lse, diag_o, diag_lse).to(q.dtype)
    q_pos = start + torch.arange(n, device=q.device)
    mask = torch.arange(start + n, device=q.device)[None, :] <= q_pos[:, None]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


def merge_by_lse(o1: Tensor, lse1: Tensor, o2: Tensor, lse2: Tensor) -> Tensor:
    """Softmax attention over the union of two disjoint key sets, from each part's
    output [B, H, n, D] and log-sum-exp [B, H, n]: o = sum_i o_i * exp(lse_i - lse)."""
    lse = torch.logaddexp(lse1, lse2)
    w1 = torch.exp(lse1 - lse).unsqueeze(-1)
    w2 = torch.exp(lse2 - lse).unsqueeze(-1)
    return o1 * w1 + o2 * w2
