"""The experts' two kernels (``engine/moe.py``) against each other on CPU: the grouped
GEMM (``torch._grouped_mm``) computes the sorted-token loop's function, fp32 within
1e-5 and bf16 within one bf16 step (2^-7 of the largest output), for idle experts, a
single token and the ``counted`` mask, with the same load counts; the rule that
picks a kernel, for devices and capabilities this machine need not have (the CPU's
choice is the loop, so the block's own choice is checked as an sm90 GPU would make
it); and the fallback to the loop for unaligned shapes and weights."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from vertumnus.config import PRESETS, ModelConfig
from vertumnus.engine import moe as moe_module
from vertumnus.engine.model import SparseMoeBlock
from vertumnus.engine.moe import (
    Kernel,
    expert_kernel,
    grouped_mm_experts,
    grouped_mm_layout_ok,
    loop_experts,
)

CPU = torch.device("cpu")
CUDA = torch.device("cuda")  # a device description only: nothing here runs on it
FP32_ATOL = 1e-5
BF16_STEP = 2.0**-7  # bf16 keeps 8 significant bits: its spacing relative to a value in [1, 2)
CFG = PRESETS["tiny-moe"]  # hidden 128, 8 experts of 64, top 2
DTYPES = [torch.float32, torch.bfloat16]


def close(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> None:
    diff = float((a.float() - b.float()).abs().max()) if a.numel() else 0.0
    bound = FP32_ATOL if dtype == torch.float32 else BF16_STEP * float(b.float().abs().max())
    assert diff <= bound, f"max |grouped - loop| {diff:.3g} > {bound:.3g} ({dtype})"


def expert_weights(
    e: int, h: int, i: int, dtype: torch.dtype, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    gate_up = torch.randn(e, 2 * i, h, generator=gen) * h**-0.5  # [E, 2I, H]
    down = torch.randn(e, h, i, generator=gen) * i**-0.5  # [E, H, I]
    return gate_up.to(dtype), down.to(dtype)


def reference(
    xs: torch.Tensor, counts: list[int], gate_up: torch.Tensor, down: torch.Tensor
) -> torch.Tensor:
    """Each row's SwiGLU under its expert, one row at a time in fp32: [N, H]."""
    experts = [e for e, n in enumerate(counts) for _ in range(n)]
    rows = []
    for x, e in zip(xs.float(), experts, strict=True):
        g, u = (gate_up[e].float() @ x).chunk(2)
        rows.append(down[e].float() @ (torch.nn.functional.silu(g) * u))
    return torch.stack(rows)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    "counts",
    [[0, 5, 1, 0, 17, 3, 0, 2], [0, 0, 0, 1, 0, 0, 0, 0], [4, 0, 0, 0, 0, 0, 0, 9]],
    ids=["idle_experts", "single_row", "first_and_last_only"],
)
def test_grouped_mm_computes_the_loops_function(dtype: torch.dtype, counts: list[int]) -> None:
    h, i = 64, 32  # rows of 16 bytes' multiples in both dtypes
    gate_up, down = expert_weights(len(counts), h, i, dtype)
    xs = torch.randn(sum(counts), h, generator=torch.Generator().manual_seed(1)).to(dtype)
    n = torch.tensor(counts)
    looped = loop_experts(xs, n, gate_up, down)
    grouped = grouped_mm_experts(xs, n, gate_up, down)
    assert grouped.shape == looped.shape == (sum(counts), h) and grouped.dtype == dtype
    close(grouped, looped, dtype)
    # Both are the per-row SwiGLU, to the dtype's rounding of the two products.
    exact = reference(xs, counts, gate_up, down)
    bound = 1e-5 if dtype == torch.float32 else 4 * BF16_STEP * float(exact.abs().max())
    assert float((grouped.float() - exact).abs().max()) <= bound


def block(cfg: ModelConfig, dtype: torch.dtype, idle: tuple[int, ...] = ()) -> SparseMoeBlock:
    """A block with seeded weights; the experts in ``idle`` never win a token whose
    feature 0 is large (``tokens``), the others always outscore them."""
    moe = SparseMoeBlock(cfg)
    gen = torch.Generator().manual_seed(2)
    e, h, i = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
    with torch.no_grad():
        router = torch.randn(e, h, generator=gen) * 0.05
        router[:, 0] = torch.tensor([-1.0 if x in idle else 1.0 for x in range(e)])
        moe.gate.weight.copy_(router)
        gate_up, down = expert_weights(e, h, i, torch.float32, seed=3)
        moe.experts.gate_up_proj.copy_(gate_up)
        moe.experts.down_proj.copy_(down)
    return moe.to(dtype)


def tokens(t: int, h: int, dtype: torch.dtype) -> torch.Tensor:
    x = torch.randn(t, h, generator=torch.Generator().manual_seed(4))
    x[:, 0] = 10.0  # router logits: about +10 for active experts, -10 for idle ones
    return x.to(dtype)


def run(
    moe: SparseMoeBlock, kernel: Kernel | None, x: torch.Tensor, counted: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The block's output and the load it counted, with ``kernel`` forced (None: its own)."""
    moe.kernel = kernel
    moe.tokens_per_expert.zero_()
    with torch.inference_mode():
        out = moe(x, counted)
    return out, moe.tokens_per_expert.clone()


@pytest.fixture
def as_on_sm90(monkeypatch: pytest.MonkeyPatch) -> None:
    """The block chooses as it would on an H100 (bf16 there), running here on CPU."""

    def choose(device: torch.device, dtype: torch.dtype, hidden: int, inter: int) -> Kernel:
        return expert_kernel(CUDA, torch.bfloat16, hidden, inter, capability=(9, 0))

    monkeypatch.setattr(moe_module, "expert_kernel", choose)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("t", [1, 37], ids=["one_token", "37_tokens"])
def test_block_kernels_agree_with_idle_experts_and_the_counted_mask(
    dtype: torch.dtype, t: int
) -> None:
    idle = (0, 5, 7)
    moe = block(CFG, dtype, idle)
    x = tokens(t, CFG.hidden_size, dtype)
    counted = torch.arange(t) % 3 != 1  # padding rows: computed, not counted
    assert moe.chosen_kernel() == "loop"  # on CPU
    looped, loop_load = run(moe, "loop", x, counted)
    grouped, grouped_load = run(moe, "grouped_mm", x, counted)
    auto, auto_load = run(moe, None, x, None)
    close(grouped, looped, dtype)
    assert torch.equal(auto, looped)
    # Each counted token is served by top_k active experts; the idle ones serve none.
    assert torch.equal(grouped_load, loop_load)
    assert int(loop_load.sum()) == CFG.num_experts_per_tok * int(counted.sum())
    assert all(int(loop_load[e]) == 0 for e in idle)
    assert int(auto_load.sum()) == CFG.num_experts_per_tok * t
    assert all(int(auto_load[e]) == 0 for e in idle)


@pytest.mark.usefixtures("as_on_sm90")
def test_block_runs_its_choice_where_grouped_mm_is_chosen() -> None:
    moe = block(CFG, torch.bfloat16, idle=(3,))
    x = tokens(21, CFG.hidden_size, torch.bfloat16)
    assert moe.chosen_kernel() == "grouped_mm"
    auto, auto_load = run(moe, None, x, None)
    grouped, _ = run(moe, "grouped_mm", x, None)
    looped, loop_load = run(moe, "loop", x, None)
    assert torch.equal(auto, grouped)
    close(auto, looped, torch.bfloat16)
    assert torch.equal(auto_load, loop_load) and int(auto_load[3]) == 0


@pytest.mark.usefixtures("as_on_sm90")
def test_unaligned_experts_fall_back_to_the_loop() -> None:
    # I = 6: bf16 rows of 12 bytes, which torch._grouped_mm refuses, on CPU as on CUDA.
    cfg = dataclasses.replace(CFG, moe_intermediate_size=6)
    moe = block(cfg, torch.bfloat16)
    assert moe.chosen_kernel() == "loop"
    x = tokens(9, cfg.hidden_size, torch.bfloat16)
    auto, _ = run(moe, None, x, None)
    looped, _ = run(moe, "loop", x, None)
    assert torch.equal(auto, looped)
    with pytest.raises(RuntimeError, match="16 bytes"):
        run(moe, "grouped_mm", x, None)


@pytest.mark.usefixtures("as_on_sm90")
def test_misaligned_weight_storage_falls_back_to_the_loop() -> None:
    moe = block(CFG, torch.float32)
    assert moe.chosen_kernel() == "grouped_mm"
    e, h, i = CFG.num_experts, CFG.hidden_size, CFG.moe_intermediate_size
    with torch.no_grad():
        # The same values, starting 4 bytes into a buffer: not on a 16-byte boundary.
        shifted = torch.empty(e * 2 * i * h + 1)[1:].view(e, 2 * i, h)
        shifted.copy_(moe.experts.gate_up_proj)
        moe.experts.gate_up_proj = torch.nn.Parameter(shifted)
    assert not grouped_mm_layout_ok(moe.experts.gate_up_proj, moe.experts.down_proj)
    assert moe.chosen_kernel() == "loop"
    transposed = moe.experts.down_proj.transpose(1, 2).contiguous().transpose(1, 2)
    assert not grouped_mm_layout_ok(transposed)
    assert grouped_mm_layout_ok(moe.experts.down_proj)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(2048, 768), (128, 64)], ids=["qwen3_30b", "tiny_moe"])
def test_kernel_choice_on_cpu_and_other_devices_is_the_loop(
    dtype: torch.dtype, shape: tuple[int, int]
) -> None:
    # torch's CPU _grouped_mm is its per-group fallback, measured no faster than the loop.
    assert expert_kernel(CPU, dtype, *shape) == "loop"
    assert expert_kernel(torch.device("meta"), dtype, *shape) == "loop"


def test_kernel_choice_needs_rows_of_16_bytes() -> None:
    sm90 = (9, 0)
    assert expert_kernel(CUDA, torch.bfloat16, 128, 64, sm90) == "grouped_mm"
    assert expert_kernel(CUDA, torch.bfloat16, 128, 36, sm90) == "loop"  # 72 bytes
    assert expert_kernel(CUDA, torch.bfloat16, 2052, 768, sm90) == "loop"  # 4104 bytes
    assert expert_kernel(CUDA, torch.bfloat16, 2056, 776, sm90) == "grouped_mm"


@pytest.mark.parametrize(
    ("dtype", "capability", "torch_version", "kernel"),
    [
        (torch.bfloat16, (9, 0), (2, 13), "grouped_mm"),  # H100, H200
        (torch.bfloat16, (10, 0), (2, 13), "grouped_mm"),  # B200
        (torch.bfloat16, (10, 0), (2, 8), "loop"),  # 2.8's kernel: sm90 only
        (torch.bfloat16, (9, 0), (2, 8), "grouped_mm"),
        (torch.bfloat16, (8, 0), (2, 13), "loop"),  # A100: torch's per-group fallback
        (torch.bfloat16, (8, 9), (2, 13), "loop"),  # L4, L40
        (torch.bfloat16, (12, 0), (2, 13), "loop"),  # RTX 50xx: no CUTLASS kernel
        (torch.float16, (9, 0), (2, 13), "loop"),
        (torch.float32, (9, 0), (2, 13), "loop"),
        (torch.bfloat16, (9, 0), (2, 7), "loop"),
    ],
)
def test_kernel_choice_on_cuda(
    dtype: torch.dtype, capability: tuple[int, int], torch_version: tuple[int, int], kernel: str
) -> None:
    choice = expert_kernel(CUDA, dtype, 2048, 768, capability, torch_version)
    assert choice == kernel
    # An unaligned shape is the loop's on any device.
    assert expert_kernel(CUDA, dtype, 2048, 772, capability, torch_version) == "loop"


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_grouped_mm_with_biases_and_gpt_oss_activation(dtype: torch.dtype) -> None:
    """gpt-oss's experts (biases on both projections, the clamped SwiGLU) on the
    grouped-GEMM path compute the loop's function, and the loop's is the per-row one."""
    from vertumnus.engine.moe import clamped_swiglu

    counts = [0, 5, 1, 0, 17, 3, 0, 2]
    h, i = 64, 32
    gate_up, down = expert_weights(len(counts), h, i, dtype)
    gen = torch.Generator().manual_seed(2)
    b1 = torch.randn(len(counts), 2 * i, generator=gen).to(dtype)
    b2 = torch.randn(len(counts), h, generator=gen).to(dtype)
    xs = (3 * torch.randn(sum(counts), h, generator=gen)).to(dtype)  # some clamp
    n = torch.tensor(counts)
    act = clamped_swiglu(1.702, 7.0)
    looped = loop_experts(xs, n, gate_up, down, act, b1, b2)
    grouped = grouped_mm_experts(xs, n, gate_up, down, act, b1, b2)
    if dtype == torch.float32:
        close(grouped, looped, dtype)
    else:  # grouped rounds each product, then adds its bias: one rounding more
        step = BF16_STEP * float(looped.float().abs().max())
        assert float((grouped.float() - looped.float()).abs().max()) <= 2 * step
    experts = [e for e, c in enumerate(counts) for _ in range(c)]
    rows = []
    for x, e in zip(xs.float(), experts, strict=True):
        g, u = (gate_up[e].float() @ x + b1[e].float()).chunk(2)
        g = g.clamp(max=7.0)
        glu = (u.clamp(-7.0, 7.0) + 1) * g * torch.sigmoid(1.702 * g)
        rows.append(down[e].float() @ glu + b2[e].float())
    exact = torch.stack(rows)
    bound = 1e-4 if dtype == torch.float32 else 8 * BF16_STEP * float(exact.abs().max())
    assert float((looped.float() - exact).abs().max()) <= bound
    assert float((grouped.float() - exact).abs().max()) <= bound
