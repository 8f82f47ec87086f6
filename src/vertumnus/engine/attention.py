"""Attention of a block of queries over a prefix of keys, bottom-right causal.

Owns the kernel choice for the one attention shape the zigzag engine needs: queries
at key positions ``[start, start + n)`` attend to keys ``[0, start + n)``, i.e. to a
fully visible part ``[0, start)`` (cached prefix and earlier suffix chunks) and
causally to their own block ``[start, start + n)``.

Never a dense mask. Fused kernels skip the masked half only for a causal mask they
know; a boolean bottom-right mask makes them compute every block (for zigzag rank
C-1, and for any prefix, up to half the attention work wasted) and, on CUDA, rules
out the flash kernel altogether. So each device gets a fused kernel that knows the
bottom-right causal shape:

    kernel                 when                          how
    sdpa-causal            start = 0 (square)            SDPA is_causal (top-left =
                                                         bottom-right), GQA in-kernel
    cpu-split              CPU, start > 0                two fused CPU flash calls, the
                                                         visible part and the causal
                                                         diagonal, merged by log-sum-exp
    flash-lower-right      CUDA, flash can run           SDPA with ``causal_lower_right``
                           (bf16/fp16, head dim)         (flash's causal is bottom-right
                                                         aligned), GQA in-kernel
    efficient-lower-right  CUDA, flash cannot (fp32)     the same bias on the
                                                         memory-efficient kernel
                                                         (custom mask type 2), which
                                                         has no GQA: K/V heads expanded

With GQA and no flash, SDPA itself would fall back to the math kernel (a dense score
matrix), so the KV heads are expanded first whenever flash cannot run on CUDA,
``start = 0`` included.

Shapes: q [1, Hq, n, D]; k, v [1, Hkv, start + n, D] (GQA: Hq a multiple of Hkv).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention.bias import causal_lower_right

# Fused CPU flash attention that also returns the log-sum-exp (GQA-aware).
_flash_cpu = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)

KERNELS = ("sdpa-causal", "cpu-split", "flash-lower-right", "efficient-lower-right")


def choose_kernel(device_type: str, start: int, flash_ok: bool) -> str:
    """The kernel of one call (module docstring); ``flash_ok``: CUDA's flash kernel
    accepts these tensors (``torch.backends.cuda.can_use_flash_attention``)."""
    if device_type == "cuda":
        return "flash-lower-right" if flash_ok else "efficient-lower-right"
    if start == 0 or _flash_cpu is None:
        return "sdpa-causal"
    return "cpu-split"


def _flash_can_run(q: Tensor, k: Tensor, v: Tensor) -> bool:
    if q.device.type != "cuda":
        return False
    from torch.backends.cuda import SDPAParams, can_use_flash_attention

    return bool(can_use_flash_attention(SDPAParams(q, k, v, None, 0.0, False, True), False))


def prefix_causal_attention(q: Tensor, k: Tensor, v: Tensor, start: int) -> Tensor:
    """Queries at positions ``start + i`` see keys ``0 .. start + i``; returns [1, Hq, n, D]."""
    n = q.shape[2]
    if k.shape[2] != start + n:
        raise ValueError(f"expected {start + n} keys for {n} queries at {start}, got {k.shape[2]}")
    return run_kernel(choose_kernel(q.device.type, start, _flash_can_run(q, k, v)), q, k, v, start)


def run_kernel(kernel: str, q: Tensor, k: Tensor, v: Tensor, start: int) -> Tensor:
    """``kernel`` on these tensors, whatever their device: the CUDA kernels' arithmetic
    (bias orientation, head expansion) also runs on CPU, where SDPA computes it by the
    math kernel, so tests check every path without a GPU."""
    n = q.shape[2]
    match kernel:
        case "sdpa-causal":
            if start:
                raise ValueError("sdpa-causal is for queries without a visible prefix")
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        case "cpu-split":
            if _flash_cpu is None or not start:
                raise ValueError("cpu-split needs torch's CPU flash kernel and a prefix")
            seen_o, seen_lse = _flash_cpu(q, k[:, :, :start], v[:, :, :start], 0.0, False)
            diag_o, diag_lse = _flash_cpu(q, k[:, :, start:], v[:, :, start:], 0.0, True)
            return merge_by_lse(seen_o, seen_lse, diag_o, diag_lse).to(q.dtype)
        case "flash-lower-right":
            return _lower_right(q, k, v, start, n, gqa=True)
        case "efficient-lower-right":
            group = q.shape[1] // k.shape[1]
            if group > 1:  # [1, Hkv, N, D] -> [1, Hq, N, D]: query head h reads KV head h // group
                k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
            return _lower_right(q, k, v, start, n, gqa=False)
    raise ValueError(f"unknown attention kernel {kernel!r}; known: {', '.join(KERNELS)}")


def _lower_right(q: Tensor, k: Tensor, v: Tensor, start: int, n: int, gqa: bool) -> Tensor:
    if start == 0:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    bias = causal_lower_right(n, start + n)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, enable_gqa=gqa)


def merge_by_lse(o1: Tensor, lse1: Tensor, o2: Tensor, lse2: Tensor) -> Tensor:
    """Softmax attention over the union of two disjoint key sets, from each part's
    output [B, H, n, D] and log-sum-exp [B, H, n]: o = sum_i o_i * exp(lse_i - lse)."""
    lse = torch.logaddexp(lse1, lse2)
    w1 = torch.exp(lse1 - lse).unsqueeze(-1)
    w2 = torch.exp(lse2 - lse).unsqueeze(-1)
    return o1 * w1 + o2 * w2
