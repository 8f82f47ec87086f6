"""DeepSeek-V4's parameters and its token-local arithmetic, unaware of parallelism.

Owns the modules (named as transformers' ``DeepseekV4ForCausalLM`` names its state
dict, so a folder loads by name), the hyper-connections, the query/KV/compressor
projections of one layer, the output projection and the mixture of experts. It does
not own attention across tokens: every layer hands its ``LayerInputs`` to an
``AttentionFn`` (``zigzag.py``), which is where the sliding window, the compressed
entries and context parallelism live. Arithmetic follows transformers' eager code
(fp32 norms, softmaxes and hyper-connection weights; the rest in the model's dtype).

Shapes carry no batch dimension: T tokens, H query heads of D channels, one KV head.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from vertumnus.config import ModelConfig
from vertumnus.config.families.deepseek_v4 import DeepseekV4Spec
from vertumnus.engine.moe import dispatch, expert_counts, kernel_for


def rms(x: Tensor, eps: float) -> Tensor:
    """Unweighted RMSNorm over the last dimension, in the input's dtype."""
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


class Norm(nn.Module):
    """RMSNorm with an fp32 weight, computed in fp32, returned in the input's dtype."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * xf).to(x.dtype)


def rope_tail(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Interleaved RoPE on the trailing ``2 * cos.shape[-1]`` channels of ``x`` [T, h, D];
    ``cos``, ``sin``: [T, rd/2] in ``x``'s dtype (pass ``-sin`` to rotate back)."""
    c = cos.repeat_interleave(2, dim=-1)[:, None]  # [T, 1, rd]
    s = sin.repeat_interleave(2, dim=-1)[:, None]
    rd = c.shape[-1]
    nope, rope = x[..., :-rd], x[..., -rd:]
    half = torch.stack((-rope[..., 1::2], rope[..., 0::2]), dim=-1).flatten(-2)
    rotated = (rope.float() * c + half.float() * s).to(x.dtype)
    return torch.cat((nope, rotated), dim=-1)


class HyperConnection(nn.Module):
    """Mixes ``n`` residual streams into a block's input and its output back into them."""

    def __init__(self, hidden: int, spec: DeepseekV4Spec, eps: float) -> None:
        super().__init__()
        n = spec.hc_mult
        self.n, self.iters, self.hc_eps, self.eps = n, spec.hc_sinkhorn_iters, spec.hc_eps, eps
        self.fn = nn.Parameter(torch.empty((2 + n) * n, n * hidden))
        self.base = nn.Parameter(torch.empty((2 + n) * n))
        self.scale = nn.Parameter(torch.empty(3))

    def forward(self, streams: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """streams [T, n, H] -> post [T, n], comb [T, n, n] (fp32), the block's input [T, H]."""
        n = self.n
        flat = rms(streams.reshape(streams.shape[0], -1).float(), self.eps)
        mixed = F.linear(flat, self.fn.float())
        pre_w, post_w, comb_w = torch.split(mixed, [n, n, n * n], dim=-1)
        pre_b, post_b, comb_b = torch.split(self.base, [n, n, n * n])
        pre_s, post_s, comb_s = self.scale.unbind(0)
        pre = torch.sigmoid(pre_w * pre_s + pre_b) + self.hc_eps
        post = 2 * torch.sigmoid(post_w * post_s + post_b)
        comb = torch.softmax(comb_w.view(-1, n, n) * comb_s + comb_b.view(n, n), dim=-1)
        comb = comb + self.hc_eps
        comb = comb / (comb.sum(dim=-2, keepdim=True) + self.hc_eps)
        for _ in range(self.iters - 1):  # Sinkhorn: rows, then columns, sum to 1
            comb = comb / (comb.sum(dim=-1, keepdim=True) + self.hc_eps)
            comb = comb / (comb.sum(dim=-2, keepdim=True) + self.hc_eps)
        collapsed = (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
        return post, comb, collapsed


def hc_merge(streams: Tensor, out: Tensor, post: Tensor, comb: Tensor) -> Tensor:
    """The streams after a block: ``post`` spreads its output, ``comb``^T mixes the old."""
    dtype = streams.dtype
    mixed = torch.matmul(comb.to(dtype).transpose(-1, -2), streams)
    return post.to(dtype).unsqueeze(-1) * out.unsqueeze(-2) + mixed


class HyperHead(nn.Module):
    def __init__(self, hidden: int, spec: DeepseekV4Spec, eps: float) -> None:
        super().__init__()
        n = spec.hc_mult
        self.hc_eps, self.eps = spec.hc_eps, eps
        self.hc_fn = nn.Parameter(torch.empty(n, n * hidden))
        self.hc_base = nn.Parameter(torch.empty(n))
        self.hc_scale = nn.Parameter(torch.empty(1))

    def forward(self, streams: Tensor) -> Tensor:
        flat = rms(streams.flatten(1).float(), self.eps)
        mixes = F.linear(flat, self.hc_fn.float())
        pre = torch.sigmoid(mixes * self.hc_scale.float() + self.hc_base.float()) + self.hc_eps
        return (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)


class Scorer(nn.Module):
    def __init__(self, cfg: ModelConfig, spec: DeepseekV4Spec) -> None:
        super().__init__()
        self.weights_proj = nn.Linear(cfg.hidden_size, spec.index_n_heads, bias=False)


class Indexer(nn.Module):
    """The lightning indexer's compressor (overlapping windows, ``index_head_dim``) and
    its query projection and head weights."""

    def __init__(self, cfg: ModelConfig, spec: DeepseekV4Spec, ratio: int) -> None:
        super().__init__()
        di = spec.index_head_dim
        self.kv_proj = nn.Linear(cfg.hidden_size, 2 * di, bias=False)
        self.gate_proj = nn.Linear(cfg.hidden_size, 2 * di, bias=False)
        self.position_bias = nn.Parameter(torch.empty(ratio, 2 * di))
        self.kv_norm = Norm(di, cfg.rms_norm_eps)
        self.q_b_proj = nn.Linear(spec.q_lora_rank, spec.index_n_heads * di, bias=False)
        self.scorer = Scorer(cfg, spec)


class Compressor(nn.Module):
    """One entry per ``ratio`` tokens: softmax-gated pooling of a window (HCA) or of two
    overlapping windows (CSA, ``overlap``: the previous window's first half of the
    channels with this window's second half), then RMSNorm and RoPE."""

    def __init__(self, cfg: ModelConfig, spec: DeepseekV4Spec, ratio: int) -> None:
        super().__init__()
        d, self.ratio, self.overlap = cfg.head_dim, ratio, ratio == 4
        width = 2 * d if self.overlap else d
        self.kv_proj = nn.Linear(cfg.hidden_size, width, bias=False)
        self.gate_proj = nn.Linear(cfg.hidden_size, width, bias=False)
        self.position_bias = nn.Parameter(torch.empty(ratio, width))
        self.kv_norm = Norm(d, cfg.rms_norm_eps)
        self.indexer = Indexer(cfg, spec, ratio) if self.overlap else None


@dataclass
class LayerInputs:
    """What one layer's attention needs of this rank's T tokens."""

    q: Tensor  # [T, H, D] after its norm and RoPE
    kv: Tensor  # [T, D] the shared key/value, after its norm and RoPE
    window: int
    sinks: Tensor  # [H] fp32
    ratio: int  # 0: sliding only; else the compressor's
    compressor: Compressor | None
    comp_kv: Tensor | None = None  # [T, D or 2D] the compressor's projections
    comp_gate: Tensor | None = None  # [T, D or 2D], with the position bias not yet added
    index_kv: Tensor | None = None  # [T, 2 Di] (CSA)
    index_gate: Tensor | None = None
    index_q: Tensor | None = None  # [T, Hi, Di] after RoPE
    index_w: Tensor | None = None  # [T, Hi] fp32 head weights, scaled


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, spec: DeepseekV4Spec, layer: int) -> None:
        super().__init__()
        h, d, hidden = cfg.num_attention_heads, cfg.head_dim, cfg.hidden_size
        self.num_heads, self.head_dim, self.eps = h, d, cfg.rms_norm_eps
        self.ratio = spec.compress_ratios[layer]
        self.window = cfg.sliding_window or 128
        self.groups = spec.o_groups
        self.q_a_proj = nn.Linear(hidden, spec.q_lora_rank, bias=False)
        self.q_a_norm = Norm(spec.q_lora_rank, cfg.rms_norm_eps)
        self.q_b_proj = nn.Linear(spec.q_lora_rank, h * d, bias=False)
        self.kv_proj = nn.Linear(hidden, d, bias=False)
        self.kv_norm = Norm(d, cfg.rms_norm_eps)
        self.o_a_proj = nn.Linear(
            h * d // spec.o_groups, spec.o_groups * spec.o_lora_rank, bias=False
        )
        self.o_b_proj = nn.Linear(spec.o_groups * spec.o_lora_rank, hidden, bias=False)
        self.sinks = nn.Parameter(torch.empty(h))
        self.compressor = Compressor(cfg, spec, self.ratio) if self.ratio else None

    def inputs(self, h: Tensor, cos: Tensor, sin: Tensor) -> LayerInputs:
        """The layer's projections of the normed block input ``h`` [T, hidden]; ``cos``,
        ``sin`` [T, rd/2] of this layer's RoPE at the tokens' positions."""
        t = h.shape[0]
        q_res = self.q_a_norm(self.q_a_proj(h))
        q = rms(self.q_b_proj(q_res).view(t, self.num_heads, self.head_dim), self.eps)
        q = rope_tail(q, cos, sin)
        kv = rope_tail(self.kv_norm(self.kv_proj(h))[:, None], cos, sin)[:, 0]
        out = LayerInputs(q, kv, self.window, self.sinks, self.ratio, self.compressor)
        comp = self.compressor
        if comp is not None:
            out.comp_kv, out.comp_gate = comp.kv_proj(h), comp.gate_proj(h)
            if comp.indexer is not None:
                ix = comp.indexer
                out.index_kv, out.index_gate = ix.kv_proj(h), ix.gate_proj(h)
                iq = ix.q_b_proj(q_res).view(t, -1, ix.kv_norm.weight.shape[0])
                out.index_q = rope_tail(iq, cos, sin)
                heads = iq.shape[1]
                out.index_w = ix.scorer.weights_proj(h).float() * heads**-0.5
        return out

    def output(self, attn: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """Attention's output [T, H, D] rotated back at the queries' positions, through
        the grouped low-rank projection: [T, hidden]."""
        t = attn.shape[0]
        attn = rope_tail(attn, cos, -sin)
        grouped = attn.reshape(t, self.groups, -1).transpose(0, 1)  # [G, T, H*D/G]
        w = self.o_a_proj.weight.view(self.groups, -1, grouped.shape[-1])  # [G, r, H*D/G]
        low = torch.bmm(grouped, w.transpose(1, 2)).transpose(0, 1).reshape(t, -1)
        out: Tensor = self.o_b_proj(low)
        return out


class Router(nn.Module):
    tid2eid: Tensor  # [vocab, k] the experts of each token id (hash layers)
    e_score_correction_bias: Tensor  # [E] fp32, added to the scores to choose (others)

    def __init__(self, cfg: ModelConfig, spec: DeepseekV4Spec, hashed: bool) -> None:
        super().__init__()
        self.hashed, self.top_k, self.score = hashed, cfg.num_experts_per_tok, spec.scoring_func
        self.scaling = spec.routed_scaling_factor
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, cfg.hidden_size))
        table = (cfg.vocab_size, cfg.num_experts_per_tok)
        if hashed:
            self.register_buffer("tid2eid", torch.zeros(table, dtype=torch.long))
        else:
            self.register_buffer("e_score_correction_bias", torch.zeros(cfg.num_experts))

    def route(self, x: Tensor, ids: Tensor) -> tuple[Tensor, Tensor]:
        """Weights [T, k] and chosen experts [T, k] of tokens ``x`` [T, H] with ids [T]."""
        logits = F.linear(x, self.weight)
        if self.score == "sqrtsoftplus":
            scores = F.softplus(logits).sqrt()
        elif self.score == "sigmoid":
            scores = torch.sigmoid(logits)
        else:
            scores = torch.softmax(logits, dim=-1)
        if self.hashed:
            chosen = self.tid2eid[ids].long()
        else:
            bias = self.e_score_correction_bias
            chosen = torch.topk(scores + bias, self.top_k, dim=-1, sorted=False).indices
        weights = scores.gather(1, chosen)
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.scaling, chosen


class Experts(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        e, i, h = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, h))
        self.down_proj = nn.Parameter(torch.empty(e, h, i))


class SharedExpert(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        h, i = cfg.hidden_size, cfg.moe_intermediate_size
        self.gate_proj = nn.Linear(h, i, bias=False)
        self.up_proj = nn.Linear(h, i, bias=False)
        self.down_proj = nn.Linear(i, h, bias=False)


class MoE(nn.Module):
    """Routed experts (by score or by the token-id table) plus the shared expert, gate
    and up clamped at ``swiglu_limit`` in both."""

    tokens_per_expert: Tensor

    def __init__(self, cfg: ModelConfig, spec: DeepseekV4Spec, layer: int) -> None:
        super().__init__()
        self.num_experts, limit = cfg.num_experts, spec.swiglu_limit
        self.gate = Router(cfg, spec, spec.hash_layers[layer])
        self.experts = Experts(cfg)
        self.shared_experts = SharedExpert(cfg)

        def act(g: Tensor, u: Tensor) -> Tensor:
            return F.silu(g.clamp(max=limit)) * u.clamp(min=-limit, max=limit)

        self.act = act
        self.register_buffer(
            "tokens_per_expert", torch.zeros(cfg.num_experts, dtype=torch.long), persistent=False
        )

    def forward(self, x: Tensor, ids: Tensor, counted: Tensor | None = None) -> Tensor:
        weights, chosen = self.gate.route(x, ids)
        self.tokens_per_expert += expert_counts(chosen, counted, self.num_experts)
        ex = self.experts
        experts = (ex.gate_up_proj, ex.down_proj)
        routed = dispatch(x, weights, chosen, experts, self.act, kernel_for(*experts))
        s = self.shared_experts
        shared: Tensor = s.down_proj(self.act(s.gate_proj(x), s.up_proj(x)))
        return routed + shared
