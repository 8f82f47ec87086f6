"""The arithmetic around attention in a decoder layer, eager or compiled.

Owns, as free functions of tensors, everything a layer computes besides attention
itself and the sparse experts: RMSNorm, the q/k/v projections with their biases, the
per-head q/k norm where a family has one, and RoPE (``attention_in``), the output
projection, residual and post-attention norm (``attention_out``), and for a dense
layer the SwiGLU MLP and its residual too (``dense_out``). ``model.py`` calls the
first and the last through a ``LayerFns``: ``EAGER`` runs them op by op;
``compiled_layer_fns()`` runs them through ``torch.compile`` (Inductor), which fuses
the elementwise chain (fp32 upcasts, norms, RoPE, SiLU, residual adds) into a few
loops between the matmuls, the way vLLM compiles its model. A sparse layer's
``attention_out`` stays eager: its router turns the compiled norm's different rounding
into other experts (docs/architecture.md, "Numerics"). Compiled, eager casts are
emulated (``emulate_precision_casts``): ``attention_in`` is then bit for bit the eager
one in bf16.

Why: on one CPU core, op-by-op elementwise work was about a third of a bf16 prefill
(each op one pass over a [T, hidden] tensor); fused, the layer is its matmuls and
attention. Free functions, not module methods: every layer passes its own weights as
arguments, so one compiled graph (dynamic in T) serves every layer and every length.

``prepare_layers`` picks the functions for a rank at start-up from ``[engine] compile``
and compiles them there (one short warm-up prefill), so no request pays for it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor

if TYPE_CHECKING:
    from vertumnus.engine.model import CausalLM

COMPILE_MODES = ("auto", "on", "off")


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        # One fused kernel; the same arithmetic as below when everything is fp32.
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    # Normalise in fp32, scale in the input dtype (as Qwen3RMSNorm does).
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def swiglu(x: Tensor, gate: Tensor, up: Tensor, down: Tensor) -> Tensor:
    # SiLU in place: one [T, intermediate] buffer less when eager.
    return F.linear(F.silu(F.linear(x, gate), inplace=True).mul_(F.linear(x, up)), down)


def attention_in(
    x: Tensor,
    cos: Tensor,
    sin: Tensor,
    norm: Tensor,
    wq: Tensor,
    bq: Tensor | None,
    wk: Tensor,
    bk: Tensor | None,
    wv: Tensor,
    bv: Tensor | None,
    q_norm: Tensor | None,
    k_norm: Tensor | None,
    heads: int,
    kv_heads: int,
    eps: float,
) -> tuple[Tensor, Tensor, Tensor]:
    """Residual stream [T, hidden] -> q [T, Hq, D], k and v [T, Hkv, D], after the
    input norm, the projections, the per-head q/k norm (where the family has one) and
    RoPE (q and k)."""
    t, d = x.shape[0], wq.shape[0] // heads
    h = rms_norm(x, norm, eps)
    q = F.linear(h, wq, bq).view(t, heads, d)
    k = F.linear(h, wk, bk).view(t, kv_heads, d)
    if q_norm is not None and k_norm is not None:
        q, k = rms_norm(q, q_norm, eps), rms_norm(k, k_norm, eps)
    v = F.linear(h, wv, bv).view(t, kv_heads, d)
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v


def attention_out(
    x: Tensor, out: Tensor, wo: Tensor, bo: Tensor | None, norm: Tensor, eps: float
) -> tuple[Tensor, Tensor]:
    """Residual stream and attention's output [T, Hq, D] -> the new residual stream
    and its post-attention norm (the MLP's input)."""
    x = x + F.linear(out.reshape(x.shape[0], -1), wo, bo)
    return x, rms_norm(x, norm, eps)


def dense_out(
    x: Tensor,
    out: Tensor,
    wo: Tensor,
    bo: Tensor | None,
    norm: Tensor,
    gate: Tensor,
    up: Tensor,
    down: Tensor,
    eps: float,
) -> Tensor:
    """``attention_out`` then the SwiGLU MLP and its residual: the layer's output."""
    x, h = attention_out(x, out, wo, bo, norm, eps)
    return x + swiglu(h, gate, up, down)


@dataclass(frozen=True)
class LayerFns:
    """The functions a model's layers call, and how they run."""

    name: str  # "eager" or "compiled"
    attention_in: Callable[..., tuple[Tensor, Tensor, Tensor]]
    dense_out: Callable[..., Tensor]


EAGER = LayerFns("eager", attention_in, dense_out)

_compiled: LayerFns | None = None
_compiled_lock = threading.Lock()


def compiled_layer_fns() -> LayerFns:
    """The same functions through ``torch.compile`` (dynamic in T; compiled lazily at
    their first call, once per process and shared by every model in it)."""
    global _compiled
    with _compiled_lock:
        if _compiled is None:
            import torch._inductor.config as inductor

            # No pool of compile workers: a rank shares its host's cores with the others.
            inductor.compile_threads = 1
            inductor.emulate_precision_casts = True
            _compiled = LayerFns(
                "compiled",
                torch.compile(attention_in, dynamic=True),
                torch.compile(dense_out, dynamic=True),
            )
        return _compiled


def prepare_layers(model: CausalLM, mode: str, warm_up: Callable[[], object]) -> str | None:
    """Set ``model.layer_fns`` for ``[engine] compile = mode`` and compile now by
    running ``warm_up`` (a short prefill). Returns None, or why the layers run eager
    under ``auto`` (no compiler, an Inductor error: the ranks stay up, slower). Under
    ``on`` the same failure raises: the rank does not start."""
    if mode not in COMPILE_MODES:
        raise ValueError(f"compile must be one of {', '.join(COMPILE_MODES)}, got {mode!r}")
    model.layer_fns = EAGER
    if mode == "off":
        return None
    try:
        model.layer_fns = compiled_layer_fns()
        warm_up()
    except Exception as exc:
        model.layer_fns = EAGER
        if mode == "on":
            raise RuntimeError(f'[engine] compile = "on" but compiling failed: {exc}') from exc
        return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    return None
