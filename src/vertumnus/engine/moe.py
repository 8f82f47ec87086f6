"""The sparse mixture-of-experts block of every MoE family and its expert kernels.

Owns ``Experts`` (the fused expert weights, as Hugging Face's ``Qwen3MoeExperts``
holds them, with biases where the family has them), ``Router``, ``SparseMoeBlock``
(routing, dispatch sorted by expert, the per-expert load counters, Qwen2-MoE's gated
shared expert) and the two kernels that compute the experts' gated activation over
the expert-sorted assignments, the same function either way:

* ``"grouped_mm"``: one ``torch._grouped_mm`` per projection over all experts, the
  groups delimited by cumulative row offsets, so no host sync on CUDA;
* ``"loop"``: a Python loop over the active experts, one matmul pair each.

``expert_kernel`` picks one from the device, dtype and shapes. ``model.py`` builds
the decoder around the block and re-exports these names.

The families differ in three places: the router (``softmax_topk``: an fp32 softmax
over all experts, then the top k, renormalised when ``norm_topk_prob``, as Qwen3-MoE,
Qwen2-MoE and Mixtral; ``topk_softmax``: the top k logits, with a router bias, then a
softmax over those k, as gpt-oss), the activation (``swiglu``: silu(g) * u;
``clamped_swiglu``: gpt-oss's ``(clamp(u, -l, l) + 1) * g * sigmoid(alpha g)`` with
``g = min(g, l)``) and biases on the experts' projections (gpt-oss).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from vertumnus.config import ModelConfig
from vertumnus.engine.fused import swiglu

Activation = Callable[[Tensor, Tensor], Tensor]  # (gate, up) [n, I] each -> [n, I]


def silu_and_mul(g: Tensor, u: Tensor) -> Tensor:
    return F.silu(g) * u


def clamped_swiglu(alpha: float, limit: float) -> Activation:
    """gpt-oss's expert activation (``GptOssExperts._apply_gate``)."""

    def act(g: Tensor, u: Tensor) -> Tensor:
        g = g.clamp(max=limit)
        return (u.clamp(min=-limit, max=limit) + 1) * (g * torch.sigmoid(g * alpha))

    return act


Kernel = Literal["grouped_mm", "loop"]
KERNELS: tuple[Kernel, ...] = ("grouped_mm", "loop")


def _major_minor(version: str) -> tuple[int, int]:
    major, minor = version.split("+")[0].split(".")[:2]
    return int(major), int(minor)


TORCH_VERSION = _major_minor(str(torch.__version__))


def expert_kernel(
    device: torch.device,
    dtype: torch.dtype,
    hidden: int,
    inter: int,
    capability: tuple[int, int] | None = None,
    torch_version: tuple[int, int] = TORCH_VERSION,
) -> Kernel:
    """The kernel for experts of hidden size ``hidden`` and intermediate size ``inter``
    with weights of ``dtype`` on ``device``. ``capability``: the CUDA device's compute
    capability (None: asked of ``device``); ``torch_version``: (major, minor).

    The rule, for torch's ``_grouped_mm`` as of 2.13 (``GroupedBlas.cpp``,
    ``GroupedMMUtils.h``):

    * every operand's row stride must be a multiple of 16 bytes, or it raises: here
      the activations [N, H] and [N, I] and the weights' transposed views, whose
      strides are H and I elements;
    * CUDA: a CUTLASS grouped GEMM, one launch with no host sync, for bf16 on compute
      capability 9.x (torch >= 2.8) and 10.x (torch >= 2.9) only. Every other dtype
      or device (sm80, sm89, sm120) takes torch's fallback, which copies the offsets
      to the host and runs one ``mm`` per group: this module's loop without its skip
      of idle experts, so ``"loop"``. ROCm (CK kernel on gfx942/950 only): ``"loop"``;
    * CPU: torch (>= 2.9; 2.8 has no CPU kernel) runs that same fallback, and is not
      faster. Measured on a 2-core Xeon (AMX), 1 and 2 threads, fp32 and bf16, whole
      prefills of 512 and 2048 tokens (``python -m tools.bench.moe
      --kernels loop,grouped_mm``), as a multiple of the loop's time: Qwen3-30B-A3B's layer
      shape 0.93 to 1.13, slower in 6 of 8 cases (bf16 at 2048 tokens: 1.04 and
      1.13; a quieter rerun of fp32, 2 threads: 1.03 and 1.05); ``tiny-moe`` 0.96 to
      1.09; the experts alone at 2048 tokens 1.06 to
      1.21. Likely cause: it materialises the whole [N, 2I] gate/up product, where the
      loop keeps one expert's block in cache between its two matmuls. So the loop.
    """
    if not hasattr(torch, "_grouped_mm") or torch_version < (2, 8):
        return "loop"
    alignment = 16 // dtype.itemsize  # elements per 16 bytes
    if hidden % alignment or inter % alignment:
        return "loop"
    if device.type == "cuda":
        if dtype != torch.bfloat16 or torch.version.hip is not None:
            return "loop"
        major = (capability or torch.cuda.get_device_capability(device))[0]
        sm90 = major == 9
        sm100 = major == 10 and torch_version >= (2, 9)
        return "grouped_mm" if sm90 or sm100 else "loop"
    return "loop"


def grouped_mm_layout_ok(*weights: Tensor) -> bool:
    """Whether expert weights are laid out as ``grouped_mm_experts`` needs: contiguous
    (their transposed views then have the row strides ``expert_kernel`` checked) and
    starting on a 16-byte boundary (a view into a larger buffer may not)."""
    return all(w.is_contiguous() and w.data_ptr() % 16 == 0 for w in weights)


def loop_experts(
    xs: Tensor,
    counts: Tensor,
    gate_up: Tensor,
    down: Tensor,
    act: Activation = silu_and_mul,
    gate_up_bias: Tensor | None = None,
    down_bias: Tensor | None = None,
) -> Tensor:
    """Each expert's gated activation over its rows of ``xs`` [N, H], whose rows are
    sorted by expert, ``counts`` [E] rows each: [N, H]. One matmul pair per active
    expert; the counts are read on the host. Biases [E, 2I] and [E, H] where given."""
    out = torch.empty_like(xs)
    start = 0
    for e, n in enumerate(counts.tolist()):
        if n == 0:
            continue
        rows = slice(start, start + n)
        b1 = None if gate_up_bias is None else gate_up_bias[e]
        b2 = None if down_bias is None else down_bias[e]
        g, u = F.linear(xs[rows], gate_up[e], b1).chunk(2, dim=-1)  # [n, I] each
        out[rows] = F.linear(act(g, u), down[e], b2)
        start += n
    return out


def grouped_mm_experts(
    xs: Tensor,
    counts: Tensor,
    gate_up: Tensor,
    down: Tensor,
    act: Activation = silu_and_mul,
    gate_up_bias: Tensor | None = None,
    down_bias: Tensor | None = None,
) -> Tensor:
    """``loop_experts``'s function as two grouped GEMMs over all experts. Needs
    ``expert_kernel``'s alignment and ``grouped_mm_layout_ok`` weights."""
    offs = counts.cumsum(0).to(torch.int32)  # [E]: the end row of each expert's group
    gu = torch._grouped_mm(xs, gate_up.transpose(-2, -1), offs=offs)  # [N, 2I]
    if gate_up_bias is not None:
        gu = gu + gate_up_bias.repeat_interleave(counts, dim=0, output_size=xs.shape[0])
    g, u = gu.chunk(2, dim=-1)  # [N, I] each, gate first
    out = torch._grouped_mm(act(g, u), down.transpose(-2, -1), offs=offs)  # [N, H]
    if down_bias is not None:
        out = out + down_bias.repeat_interleave(counts, dim=0, output_size=xs.shape[0])
    return out


def kernel_for(gate_up: Tensor, down: Tensor, forced: Kernel | None = None) -> Kernel:
    """The kernel for expert weights as they are now (``forced``: that one)."""
    if forced is not None:
        return forced
    kernel = expert_kernel(gate_up.device, gate_up.dtype, down.shape[1], down.shape[2])
    if kernel == "grouped_mm" and not grouped_mm_layout_ok(gate_up, down):
        return "loop"
    return kernel


def expert_counts(chosen: Tensor, counted: Tensor | None, num_experts: int) -> Tensor:
    """[E] the assignments of ``chosen`` [T, k] per expert, over the rows ``counted``
    (None: all)."""
    real = chosen if counted is None else chosen[counted]
    return torch.bincount(real.reshape(-1), minlength=num_experts)


def dispatch(
    x: Tensor,
    weights: Tensor,
    chosen: Tensor,
    experts: tuple[Tensor, Tensor],
    act: Activation,
    kernel: Kernel,
    biases: tuple[Tensor | None, Tensor | None] = (None, None),
) -> Tensor:
    """The routed experts' output [T, H] for tokens ``x`` [T, H], each sent to its
    ``chosen`` [T, k] experts with ``weights`` [T, k]: the assignments sorted by
    expert, ``kernel`` over them (``experts``: gate_up [E, 2I, H], down [E, H, I]),
    weighted and summed back per token."""
    gate_up, down = experts
    top_k = chosen.shape[1]
    flat = chosen.reshape(-1)  # [T*k]: assignment a is token a // k
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=gate_up.shape[0])  # [E]
    token_of = order // top_k
    xs = x.index_select(0, token_of)  # [T*k, H], grouped by expert
    run = grouped_mm_experts if kernel == "grouped_mm" else loop_experts
    out = run(xs, counts, gate_up, down, act, biases[0], biases[1])
    out.mul_(weights.to(x.dtype).reshape(-1)[order].unsqueeze(-1))
    return torch.zeros_like(x).index_add_(0, token_of, out)


class Experts(nn.Module):
    """The experts of one sparse layer, fused as Hugging Face's ``Qwen3MoeExperts``
    holds them: ``gate_up_proj`` [E, 2I, H] (gate rows first), ``down_proj`` [E, H, I]."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        e, i, h = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, h))
        self.down_proj = nn.Parameter(torch.empty(e, h, i))
        self.gate_up_bias = nn.Parameter(torch.empty(e, 2 * i)) if cfg.expert_bias else None
        self.down_bias = nn.Parameter(torch.empty(e, h)) if cfg.expert_bias else None


class Router(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, cfg.hidden_size))
        self.bias = nn.Parameter(torch.empty(cfg.num_experts)) if cfg.router_bias else None

    def route(
        self, x: Tensor, top_k: int, kind: str, norm_topk_prob: bool
    ) -> tuple[Tensor, Tensor]:
        """Routing weights [T, k] (fp32) and the chosen experts [T, k] of ``x`` [T, H]."""
        logits = F.linear(x, self.weight, self.bias)  # [T, E]
        if kind == "topk_softmax":
            top, chosen = torch.topk(logits, top_k, dim=-1)
            return F.softmax(top, dim=-1), chosen
        probs = F.softmax(logits, dim=-1, dtype=torch.float32)
        weights, chosen = torch.topk(probs, top_k, dim=-1)
        if norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, chosen


class SharedExpert(nn.Module):
    """Qwen2-MoE's shared expert: a SwiGLU MLP every token passes through."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        h, i = cfg.hidden_size, cfg.shared_expert_intermediate_size
        self.gate_proj = nn.Linear(h, i, bias=False)
        self.up_proj = nn.Linear(h, i, bias=False)
        self.down_proj = nn.Linear(i, h, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return swiglu(x, self.gate_proj.weight, self.up_proj.weight, self.down_proj.weight)


class SparseMoeBlock(nn.Module):
    """The sparse block: the family's router picks k experts per token; each token's
    output is the routing-weighted sum of its experts' outputs (plus, for Qwen2-MoE,
    the shared expert's times ``sigmoid(shared_expert_gate(x))``).

    Dispatch is grouped by expert: the (token, expert) assignments are sorted by
    expert, the experts run over their contiguous rows (``kernel``), and the results
    are scattered back with one ``index_add_``. No Python loop over tokens.
    ``tokens_per_expert`` accumulates how many assignments each expert served (the
    load balance), until ``reset`` by the caller."""

    tokens_per_expert: Tensor  # [E] int64, a non-persistent buffer

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_experts, self.top_k = cfg.num_experts, cfg.num_experts_per_tok
        self.norm_topk_prob, self.router = cfg.norm_topk_prob, cfg.router
        self.act: Activation = silu_and_mul
        if cfg.expert_act == "clamped_swiglu":
            self.act = clamped_swiglu(cfg.swiglu_alpha, cfg.swiglu_limit)
        self.gate = Router(cfg)
        self.experts = Experts(cfg)
        self.shared_expert: SharedExpert | None = None
        self.shared_expert_gate: nn.Linear | None = None
        if cfg.shared_expert_intermediate_size:
            self.shared_expert = SharedExpert(cfg)
            self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False)
        # None: ``expert_kernel``'s choice for the weights as they are at each call; a
        # name forces that kernel (benchmarks and tests compare the two).
        self.kernel: Kernel | None = None
        self.register_buffer(
            "tokens_per_expert", torch.zeros(cfg.num_experts, dtype=torch.long), persistent=False
        )

    def chosen_kernel(self) -> Kernel:
        """The kernel ``forward`` runs with the weights as they are now."""
        return kernel_for(self.experts.gate_up_proj, self.experts.down_proj, self.kernel)

    def forward(self, x: Tensor, counted: Tensor | None = None) -> Tensor:
        """``counted``: [T] bool, the rows that count in ``tokens_per_expert`` (not
        the padding of a zigzag share); None: all."""
        weights, chosen = self.gate.route(x, self.top_k, self.router, self.norm_topk_prob)
        ex = self.experts
        self.tokens_per_expert += expert_counts(chosen, counted, self.num_experts)
        y = dispatch(
            x, weights, chosen, (ex.gate_up_proj, ex.down_proj), self.act,
            self.chosen_kernel(), (ex.gate_up_bias, ex.down_bias),
        )  # fmt: skip
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            y = y + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return y
