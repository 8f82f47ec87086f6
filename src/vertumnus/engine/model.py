"""The shared decoder of every family in plain PyTorch, unaware of parallelism.

Owns the layers and their arithmetic (RMSNorm, RoPE, grouped-query attention, SwiGLU
MLP, optional tied embeddings) and the switches by which the families differ
(``ModelConfig``, read by ``config/families/``): per-head q/k RMSNorm (Qwen3), biases
on q/k/v and on o, the RoPE type (``rope.py``), a sliding window per layer, attention
sinks, and the MLP or the mixture of experts (``moe.py``: router, expert biases and
activation, shared expert). It does not own attention itself: every layer hands its
post-RoPE queries, keys and values, with its window and sinks, to an ``AttentionFn``
supplied by the caller, which is where context parallelism, prefix caches and KV
capture live (``engine/zigzag.py``). Parameter names match the Hugging Face Qwen3
state dict; a family whose checkpoints name tensors otherwise says so in its module.

Shapes carry no batch dimension: one prefill is one sequence of T tokens.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from vertumnus.config import ModelConfig
from vertumnus.engine.attention import banded_attention
from vertumnus.engine.fused import EAGER, LayerFns, attention_out, rms_norm, swiglu
from vertumnus.engine.moe import Experts as Experts
from vertumnus.engine.moe import Router as Router
from vertumnus.engine.moe import SparseMoeBlock as SparseMoeBlock
from vertumnus.engine.rope import inv_freq, rope_cos_sin

QKV = tuple[Tensor, Tensor, Tensor]


class AttentionFn(Protocol):
    """Attention of one layer for this rank's tokens.

    ``q``: [T, Hq, D]; ``k``, ``v``: [T, Hkv, D], all after q/k-norm and RoPE, for the
    T tokens this rank computes. ``window``: the layer's sliding window (a query at
    position i sees keys after i - window); ``sinks`` [Hq]: the layer's sink logits.
    Returns [T, Hq, D] in the same token order.
    """

    def __call__(
        self,
        layer: int,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        window: int | None = None,
        sinks: Tensor | None = None,
    ) -> Tensor: ...


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        return rms_norm(x, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int = 0) -> None:
        super().__init__()
        d, hq, hkv = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim, self.num_heads, self.num_kv_heads = d, hq, hkv
        self.window = cfg.window(layer)
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(cfg.hidden_size, hq * d, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, hkv * d, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, hkv * d, bias=bias)
        self.o_proj = nn.Linear(hq * d, cfg.hidden_size, bias=cfg.o_proj_bias)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.sinks = nn.Parameter(torch.empty(hq)) if cfg.attention_sinks else None

    def qkv(self, fns: LayerFns, x: Tensor, norm: RMSNorm, cos: Tensor, sin: Tensor) -> QKV:
        """q, k, v of the residual stream ``x`` after the layer's input ``norm``."""
        q, k, v = self.q_proj, self.k_proj, self.v_proj
        qn = None if self.q_norm is None else self.q_norm.weight
        kn = None if self.k_norm is None else self.k_norm.weight
        return fns.attention_in(
            x, cos, sin, norm.weight, q.weight, q.bias, k.weight, k.bias, v.weight, v.bias,
            qn, kn, self.num_heads, self.num_kv_heads, norm.eps,
        )  # fmt: skip


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return swiglu(x, self.gate_proj.weight, self.up_proj.weight, self.down_proj.weight)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int = 0) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, layer)
        self.mlp: SparseMoeBlock | MLP = (
            SparseMoeBlock(cfg) if cfg.is_sparse_layer(layer) else MLP(cfg)
        )
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(
        self,
        layer: int,
        x: Tensor,
        cos: Tensor,
        sin: Tensor,
        attention: AttentionFn,
        counted: Tensor | None = None,
        fns: LayerFns = EAGER,
    ) -> Tensor:
        attn, norm = self.self_attn, self.post_attention_layernorm
        q, k, v = attn.qkv(fns, x, self.input_layernorm, cos, sin)
        out = attention(layer, q, k, v, attn.window, attn.sinks)
        o = attn.o_proj
        if isinstance(self.mlp, SparseMoeBlock):
            # Eager even when compiled: the router amplifies the compiled norm's other
            # rounding (tests/engine/test_bf16.py: bf16 mean error 0.0104 compiled
            # against transformers-bf16's 0.0071, past the stated bound).
            x, h = attention_out(x, out, o.weight, o.bias, norm.weight, norm.eps)
            moe: Tensor = self.mlp(h, counted)
            return x + moe
        m = self.mlp
        return fns.dense_out(
            x, out, o.weight, o.bias, norm.weight,
            m.gate_proj.weight, m.up_proj.weight, m.down_proj.weight, norm.eps,
        )  # fmt: skip


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class CausalLM(nn.Module):
    """``forward`` returns final-normed hidden states; ``logits`` projects chosen rows."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        # How the layers compute around attention (``engine/fused.py``): eager unless a
        # rank compiled them at start-up (``fused.prepare_layers``).
        self.layer_fns: LayerFns = EAGER
        # The attention kernel family on a CPU (``attention.CPU_KERNELS``): torch's flash
        # unless a rank picked the chunked kernel at start-up (``pick_cpu_kernel``).
        self.cpu_attention = "flash"
        self.model = Backbone(cfg)
        self._rope: tuple[Tensor, float] | None = None  # inverse frequencies, factor
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    def forward(
        self,
        input_ids: Tensor,
        positions: Tensor,
        attention: AttentionFn,
        counted: Tensor | None = None,
    ) -> Tensor:
        """``input_ids``, ``positions``: [T] int64 -> hidden [T, hidden] after the final
        norm. ``counted``: [T] bool, the tokens that count in the experts' load (the
        rest is padding); None: all."""
        cfg = self.config
        x = self.model.embed_tokens(input_ids)  # [T, H]
        if self._rope is None:
            self._rope = inv_freq(cfg)
        cos, sin = rope_cos_sin(positions, self._rope[0], self._rope[1], x.dtype)
        for i, layer in enumerate(self.model.layers):
            x = layer(i, x, cos, sin, attention, counted, self.layer_fns)
        hidden: Tensor = self.model.norm(x)
        return hidden

    def logits(self, hidden: Tensor) -> Tensor:
        """[N, hidden] -> [N, vocab] in fp32."""
        logits: Tensor = self.lm_head(hidden)
        return logits.float()

    def reset_expert_tokens(self) -> None:
        for layer in self.model.layers:
            if isinstance(layer.mlp, SparseMoeBlock):
                layer.mlp.tokens_per_expert.zero_()

    def expert_tokens(self, reset: bool = True) -> dict[int, list[int]] | None:
        """Assignments each expert served since the last reset, by sparse layer
        (None for a dense model)."""
        if not self.config.is_moe:
            return None
        out = {}
        for i, layer in enumerate(self.model.layers):
            if isinstance(layer.mlp, SparseMoeBlock):
                out[i] = layer.mlp.tokens_per_expert.tolist()
                if reset:
                    layer.mlp.tokens_per_expert.zero_()
        return out


def causal_attention(prefix_kv: list[tuple[Tensor, Tensor]] | None = None) -> AttentionFn:
    """Plain single-process attention: the trusted reference for the CP engine.

    The T tokens given to the model are contiguous and follow the cached prefix, whose
    per-layer (k, v) of shape [P, Hkv, D] are ``prefix_kv[layer]``.
    """

    def attend(
        layer: int,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        window: int | None = None,
        sinks: Tensor | None = None,
    ) -> Tensor:
        if prefix_kv is not None:
            pk, pv = prefix_kv[layer]
            k, v = torch.cat((pk, k)), torch.cat((pv, v))
        t, n = q.shape[0], k.shape[0]
        # [1, H, T, D]: SDPA's fused CPU kernels need the batch dimension.
        qh, kh, vh = (x.transpose(0, 1)[None] for x in (q, k, v))
        if window is not None or sinks is not None:
            out = banded_attention(qh, kh, vh, n - t, 0, window, sinks)
        elif n == t:
            out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, enable_gqa=True)
        else:  # query i sees keys 0 .. n - t + i (bottom-right aligned causal mask)
            mask = torch.ones(t, n, dtype=torch.bool, device=q.device).tril(n - t)
            out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, enable_gqa=True)
        return out[0].transpose(0, 1)

    return attend
