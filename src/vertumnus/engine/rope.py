"""Rotary position embeddings: the inverse frequencies of each RoPE type a family
uses, and the cos/sin tables of given positions.

    default   inv_freq_i = theta^(-2i/D)
    linear    default / factor (position interpolation)
    dynamic   NTK scaling of theta from the forward's length beyond
              max_position_embeddings; within it (all this engine serves) the default
    llama3    Llama 3.1: low frequencies / factor, high ones kept, a smooth ramp between
              (low_freq_factor, high_freq_factor, original_max_position_embeddings)
    yarn      YaRN: extrapolated high frequencies, interpolated low ones, a linear
              ramp between the correction dimensions of beta_fast and beta_slow; cos and
              sin scaled by the attention factor (0.1 ln(factor) + 1 unless given)

The same arithmetic as transformers' ``modeling_rope_utils`` (fp32 frequencies), so
logits match it to rounding. ``attention_factor`` multiplies cos and sin, as there.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

from vertumnus.config import ModelConfig


def _default(theta: float, dim: int) -> Tensor:
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def inv_freq(cfg: ModelConfig) -> tuple[Tensor, float]:
    """[D/2] fp32 inverse frequencies of ``cfg``'s RoPE and its attention factor."""
    dim, theta, p = cfg.head_dim, cfg.rope_theta, cfg.rope_param
    base = _default(theta, dim)
    match cfg.rope_type:
        case "default" | "dynamic":
            return base, 1.0
        case "linear":
            return base / float(p("factor", 1.0)), 1.0  # type: ignore[arg-type]
        case "llama3":
            return _llama3(cfg, base), 1.0
        case "yarn":
            return yarn(dim, theta, p, cfg.max_position_embeddings)
    raise ValueError(f"unsupported RoPE type {cfg.rope_type!r}")


def _llama3(cfg: ModelConfig, base: Tensor) -> Tensor:
    p = cfg.rope_param
    factor = float(p("factor", 8.0))  # type: ignore[arg-type]
    low, high = float(p("low_freq_factor", 1.0)), float(p("high_freq_factor", 4.0))  # type: ignore[arg-type]
    old = float(p("original_max_position_embeddings", 8192.0))  # type: ignore[arg-type]
    low_wavelen, high_wavelen = old / low, old / high
    wavelen = 2 * math.pi / base
    scaled = torch.where(wavelen > low_wavelen, base / factor, base)
    smooth = (old / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def yarn(
    dim: int, theta: float, p: Callable[..., float | None], max_positions: int
) -> tuple[Tensor, float]:
    """YaRN's [dim/2] inverse frequencies and attention factor; ``p(key[, default])``
    reads its parameters."""
    old = float(p("original_max_position_embeddings", max_positions))  # type: ignore[arg-type]
    factor = float(p("factor") or max_positions / old)
    attention = p("attention_factor")
    if attention is None:
        mscale, mscale_all = p("mscale"), p("mscale_all_dim")
        if mscale and mscale_all:
            attention = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all)
        else:
            attention = _yarn_mscale(factor)
    beta_fast, beta_slow = p("beta_fast") or 32.0, p("beta_slow") or 1.0
    truncate = bool(p("truncate", 1.0))

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(old / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no singular ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation = 1 - ramp
    freqs = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return freqs, float(attention)


def rope_cos_sin(
    positions: Tensor, freqs: Tensor, scale: float, dtype: torch.dtype
) -> tuple[Tensor, Tensor]:
    """cos, sin of shape [T, 1, D] for absolute ``positions`` [T] and inverse
    frequencies ``freqs`` [D/2], times the attention factor ``scale``."""
    angles = positions.float()[:, None] * freqs.to(positions.device)[None, :]  # [T, D/2]
    emb = torch.cat((angles, angles), dim=-1)[:, None, :]  # [T, 1, D]
    cos, sin = emb.cos(), emb.sin()
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
    return cos.to(dtype), sin.to(dtype)
