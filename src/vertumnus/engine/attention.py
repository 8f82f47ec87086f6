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
    cpu-chunked            CPU, ``cpu = "chunked"``      blocks of query rows, two batched
                           (any start)                   GEMMs each around a softmax of
                                                         the keys the block can see
    flash-lower-right      CUDA, flash can run           SDPA with ``causal_lower_right``
                           (bf16/fp16, head dim)         (flash's causal is bottom-right
                                                         aligned), GQA in-kernel
    efficient-lower-right  CUDA, flash cannot (fp32)     the same bias on the
                                                         memory-efficient kernel
                                                         (custom mask type 2), which
                                                         has no GQA: K/V heads expanded

Which CPU kernel is faster depends on the machine: torch's CPU flash kernel runs its
small GEMMs through MKL, fast where MKL has a kernel for the CPU (AMX on recent Intel
parts) and several times below the core's bf16 peak elsewhere (AMD EPYC), while
``cpu-chunked`` issues a few large batched GEMMs (oneDNN in bf16) at the price of
materialising one block's scores. ``pick_cpu_kernel`` times both on this process's
threads and keeps flash unless the chunked kernel is clearly faster.

With GQA and no flash, SDPA itself would fall back to the math kernel (a dense score
matrix), so the KV heads are expanded first whenever flash cannot run on CUDA,
``start = 0`` included.

Sliding windows and attention sinks (Mistral, Qwen2, gpt-oss) take one more kernel,
``banded_attention``: query rows in blocks, each block against only the keys inside
its window (the band), with a sink logit per query head joining each softmax's
denominator. It is exact in fp32 and costs the band, not the causal triangle.

Shapes: q [1, Hq, n, D]; k, v [1, Hkv, start + n, D] (GQA: Hq a multiple of Hkv).
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention.bias import causal_lower_right

# Fused CPU flash attention that also returns the log-sum-exp (GQA-aware).
_flash_cpu = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)

KERNELS = (
    "sdpa-causal", "cpu-split", "cpu-chunked", "flash-lower-right", "efficient-lower-right"
)  # fmt: skip
CPU_KERNELS = ("flash", "chunked")  # a CPU rank's family: torch's flash, or cpu-chunked
CHUNK_ROWS = 64  # query rows per block of cpu-chunked
TUNE_MARGIN = 0.1  # pick_cpu_kernel keeps flash unless chunked is this much faster


def choose_kernel(device_type: str, start: int, flash_ok: bool, cpu: str = "flash") -> str:
    """The kernel of one call (module docstring); ``flash_ok``: CUDA's flash kernel
    accepts these tensors (``torch.backends.cuda.can_use_flash_attention``); ``cpu``:
    the CPU family of this rank (``CPU_KERNELS``)."""
    if device_type == "cuda":
        return "flash-lower-right" if flash_ok else "efficient-lower-right"
    if cpu == "chunked":
        return "cpu-chunked"
    if start == 0 or _flash_cpu is None:
        return "sdpa-causal"
    return "cpu-split"


def _flash_can_run(q: Tensor, k: Tensor, v: Tensor) -> bool:
    if q.device.type != "cuda":
        return False
    from torch.backends.cuda import SDPAParams, can_use_flash_attention

    return bool(can_use_flash_attention(SDPAParams(q, k, v, None, 0.0, False, True), False))


def prefix_causal_attention(
    q: Tensor, k: Tensor, v: Tensor, start: int, cpu: str = "flash"
) -> Tensor:
    """Queries at positions ``start + i`` see keys ``0 .. start + i``; returns [1, Hq, n, D]."""
    n = q.shape[2]
    if k.shape[2] != start + n:
        raise ValueError(f"expected {start + n} keys for {n} queries at {start}, got {k.shape[2]}")
    kernel = choose_kernel(q.device.type, start, _flash_can_run(q, k, v), cpu)
    return run_kernel(kernel, q, k, v, start)


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
        case "cpu-chunked":
            return _chunked(q, k, v, start)
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
    return merge_with_lse(o1, lse1, o2, lse2)[0]


def merge_with_lse(o1: Tensor, lse1: Tensor, o2: Tensor, lse2: Tensor) -> tuple[Tensor, Tensor]:
    """``merge_by_lse``'s output and the union's log-sum-exp (to merge again)."""
    lse = torch.logaddexp(lse1, lse2)
    w1 = torch.exp(lse1 - lse).unsqueeze(-1)
    w2 = torch.exp(lse2 - lse).unsqueeze(-1)
    return o1 * w1 + o2 * w2, lse


def _chunked(q: Tensor, k: Tensor, v: Tensor, start: int, rows: int | None = None) -> Tensor:
    """Query rows in blocks of ``rows``: per KV head, one GEMM gives a block's scores
    against the keys it sees (the head's query heads stacked as rows, so GQA shares K
    and V), the causal diagonal is masked in place, and after the softmax a second GEMM
    gives the output. The masked triangle costs one block per block, not half the
    matrix. One ``mm`` per head rather than one ``bmm``: torch's CPU ``bmm`` copies a
    transposed operand and leaves oneDNN for a slower GEMM. The scale is folded into q;
    in bf16 the scores are rounded to bf16 before the softmax (which computes in fp32),
    where flash keeps them in fp32. ``rows``: ``CHUNK_ROWS`` unless given."""
    rows = rows or CHUNK_ROWS
    _, hq, n, d = q.shape
    hkv = k.shape[1]
    group = hq // hkv
    keys, values = k[0].contiguous(), v[0].contiguous()  # [Hkv, N, D]
    queries = (q[0] * d**-0.5).view(hkv, group, n, d)
    out = q.new_empty(hkv, group, n, d)
    above = torch.ones(rows, rows, dtype=torch.bool, device=q.device).triu_(1)
    for lo in range(0, n, rows):
        hi = min(n, lo + rows)
        b, seen = hi - lo, start + hi
        block = queries[:, :, lo:hi].reshape(hkv, group * b, d)
        scores = q.new_empty(hkv, group * b, seen)
        for h in range(hkv):
            torch.mm(block[h], keys[h, :seen].t(), out=scores[h])
        diagonal = scores.view(hkv, group, b, seen)[..., seen - b :]
        diagonal.masked_fill_(above[:b, :b], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        for h in range(hkv):
            out[h, :, lo:hi] = torch.mm(probs[h], values[h, :seen]).view(group, b, d)
    return out.view(1, hq, n, d)


BAND_ROWS = 128  # query rows per block of banded_attention


def banded_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    start: int,
    key_start: int = 0,
    window: int | None = None,
    sinks: Tensor | None = None,
) -> Tensor:
    """Queries at positions ``start + i`` over keys at ``key_start + j``: query i sees
    key positions p with ``p <= start + i`` and, with a ``window``, ``p > start + i -
    window``; ``k`` must hold every position the queries see (from ``key_start`` up to
    ``start + n``). ``sinks`` [Hq]: each query head's softmax also counts
    ``exp(sink)`` in its denominator (a value-less key). Query rows go in blocks of
    ``BAND_ROWS``; each block's scores cover only the keys its rows can see, one GEMM
    per KV head (its query heads stacked), masked at both edges of the band, softmax in
    fp32. Returns [1, Hq, n, D]."""
    _, hq, n, d = q.shape
    hkv, total = k.shape[1], k.shape[2]
    if key_start + total != start + n:
        raise ValueError(f"keys end at {key_start + total}, queries at {start + n}")
    group = hq // hkv
    queries = (q[0] * d**-0.5).view(hkv, group, n, d)
    keys, values = k[0], v[0]  # [Hkv, N, D]
    out = q.new_empty(hkv, group, n, d)
    sink = None if sinks is None else sinks.float().view(hkv, group, 1, 1)
    for lo in range(0, n, BAND_ROWS):
        hi = min(n, lo + BAND_ROWS)
        first = key_start if window is None else max(key_start, start + lo - window + 1)
        a, b = first - key_start, start + hi - key_start  # key rows the block sees
        qpos = torch.arange(start + lo, start + hi, device=q.device)[:, None]
        kpos = torch.arange(first, start + hi, device=q.device)[None, :]
        hidden = kpos > qpos
        if window is not None:
            hidden |= kpos <= qpos - window
        block = queries[:, :, lo:hi]  # [Hkv, G, rows, D]
        scores = torch.matmul(block, keys[:, None, a:b].transpose(-1, -2)).float()
        scores.masked_fill_(hidden, float("-inf"))  # [Hkv, G, rows, keys]
        if sink is None:
            probs = torch.softmax(scores, dim=-1)
        else:
            top = torch.maximum(scores.amax(dim=-1, keepdim=True), sink)
            e = torch.exp(scores - top)
            probs = e / (e.sum(dim=-1, keepdim=True) + torch.exp(sink - top))
        out[:, :, lo:hi] = torch.matmul(probs.to(v.dtype), values[:, None, a:b])
    return out.view(1, hq, n, d)


def windowed_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    start: int,
    key_start: int = 0,
    window: int | None = None,
    sinks: Tensor | None = None,
) -> Tensor:
    """``banded_attention``'s function, on a CPU through torch's fused flash kernel
    (``window_flash``) where it runs, else ``banded_attention`` itself."""
    if q.device.type == "cpu" and _flash_cpu is not None:
        return window_flash(q, k, v, start, key_start, window, sinks)
    return banded_attention(q, k, v, start, key_start, window, sinks)


def window_flash(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    start: int,
    key_start: int = 0,
    window: int | None = None,
    sinks: Tensor | None = None,
) -> Tensor:
    """``banded_attention`` by fused CPU flash calls merged by log-sum-exp. Queries go
    in blocks of w (the window; no window: one block of all), and a block at [x0,
    x0 + b) sees two parts::

        [x0, x0 + b)        itself, causally: flash with its causal mask
        [x0 - w + 1, x0)    the window's reach before it: query x0 + j sees the keys
                            at or after x0 + j - w + 1, a mask the flash kernel does
                            not know; reversed (queries and keys both), it is the
                            kernel's top-left causal mask, so the part is one flash
                            call on reversed copies (no window: all of [key_start,
                            x0), unmasked)

    The parts are merged by their log-sum-exp; a sink joins each softmax at the end,
    ``out * sigmoid(lse - sink)``. Each call runs over the band (at most 2w keys), so
    the cost is the window's, at the fused kernel's speed."""
    _, hq, n, d = q.shape
    if key_start + k.shape[2] != start + n:
        raise ValueError(f"keys end at {key_start + k.shape[2]}, queries at {start + n}")
    out = q.new_empty(1, hq, n, d)
    rows = n if window is None else window
    for lo in range(0, n, rows):
        hi = min(n, lo + rows)
        x0, b = start + lo, hi - lo
        qb = q[:, :, lo:hi]
        own = slice(x0 - key_start, x0 - key_start + b)
        o, lse = _flash_lse(qb, k[:, :, own], v[:, :, own], causal=True)
        if window is None:
            if x0 > key_start:  # every earlier key, unmasked
                before = slice(0, x0 - key_start)
                o2, lse2 = _flash_lse(qb, k[:, :, before], v[:, :, before], causal=False)
                o, lse = merge_with_lse(o, lse, o2, lse2)
        elif window > 1 and (reach := max(key_start, x0 - window + 1)) < x0:
            _merge_reach(o, lse, qb, k, v, x0 - key_start, reach - key_start, window)
        if sinks is not None:
            o = o * torch.sigmoid(lse - sinks.float().view(1, hq, 1)).unsqueeze(-1)
        out[:, :, lo:hi] = o.to(q.dtype)
    return out


def _flash_lse(q: Tensor, k: Tensor, v: Tensor, causal: bool) -> tuple[Tensor, Tensor]:
    """torch's fused CPU flash attention: the output and its log-sum-exp."""
    if _flash_cpu is None:
        raise RuntimeError("this torch has no fused CPU flash attention")
    o, lse = _flash_cpu(q, k, v, 0.0, causal)
    return o, lse


def _merge_reach(
    o: Tensor, lse: Tensor, qb: Tensor, k: Tensor, v: Tensor, x0: int, reach: int, window: int
) -> None:
    """Merge into the block's output and log-sum-exp (in place) the keys [reach, x0)
    (indices into k): query j (j < w - 1) sees those at or after x0 + j - w + 1.
    Reversed, query i = w - 2 - j sees the reversed keys m <= i: top-left causal,
    with the block's last w - 1 - nq rows padded in front when it has fewer queries."""
    nq = min(qb.shape[2], window - 1)
    pad = window - 1 - nq
    qf = qb[:, :, :nq].flip(2)
    if pad:
        qf = torch.cat((qf.new_zeros(*qf.shape[:2], pad, qf.shape[3]), qf), dim=2)
    kf, vf = k[:, :, reach:x0].flip(2), v[:, :, reach:x0].flip(2)
    o2, lse2 = _flash_lse(qf, kf, vf, causal=True)
    o2, lse2 = o2[:, :, pad:].flip(2), lse2[:, :, pad:].flip(2)
    o[:, :, :nq], lse[:, :, :nq] = merge_with_lse(o[:, :, :nq], lse[:, :, :nq], o2, lse2)


def pick_cpu_kernel(
    setting: str,
    heads: int,
    kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    lengths: tuple[int, ...] = (2048, 4096),
    rounds: int = 3,
) -> tuple[str, dict[int, dict[str, float]]]:
    """The CPU kernel family for ``setting`` (``[engine] cpu_attention``: "auto" or one
    of ``CPU_KERNELS``) and, under "auto", the best seconds of each at each length
    tried. Both run causal prefills in the model's head shape and dtype, in the
    engine's layout, on this process's threads, alternately (one warm-up call each
    first); the chunked kernel is chosen only if it is at least ``TUNE_MARGIN`` faster
    at every length in ``lengths``, tried in order until one says flash."""
    if setting in CPU_KERNELS:
        return setting, {}
    if setting != "auto":
        raise ValueError(f"cpu_attention must be auto or one of {CPU_KERNELS}, got {setting!r}")
    gen = torch.Generator().manual_seed(0)
    timed: dict[int, dict[str, float]] = {}
    for i, tokens in enumerate(lengths):

        def rows(h: int, n: int = tokens) -> Tensor:  # [1, h, n, D] over [n, h, D] memory
            return torch.randn(n, h, head_dim, generator=gen).to(dtype).transpose(0, 1)[None]

        q, k, v = rows(heads), rows(kv_heads), rows(kv_heads)
        best = timed[tokens] = {name: float("inf") for name in CPU_KERNELS}
        for round_ in range(rounds + (i == 0)):
            for name in CPU_KERNELS:
                began = time.perf_counter()
                run_kernel(choose_kernel("cpu", 0, False, name), q, k, v, 0)
                if round_ or i:  # the very first round warms both up
                    best[name] = min(best[name], time.perf_counter() - began)
        if best["chunked"] > (1 - TUNE_MARGIN) * best["flash"]:
            return "flash", timed
    return "chunked", timed
