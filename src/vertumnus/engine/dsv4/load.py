"""DeepSeek-V4's weights: seeded random ones (presets, benchmarks) or a folder.

A folder loads by name: transformers' names as ``save_pretrained`` writes them, or
DeepSeek's own (``layers.0.attn.wq_a.weight``, per-expert ``w1/w2/w3``), renamed by
``config/families/deepseek_v4_names.py``; FP8 block-scaled matrices are dequantized as
they are read (``engine/fp8.py``). The multi-token-prediction layer (``mtp.*``) is not
needed for prefill and is skipped. Parameters transformers keeps in fp32 (norms, sinks,
the compressors' position biases, the hyper-connections, the routers' correction bias)
stay fp32 whatever the model's dtype, as there.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch

from vertumnus.config import ConfigError, ModelConfig
from vertumnus.config.families.deepseek_v4_names import is_mtp, to_transformers
from vertumnus.engine.dsv4.model import DeepseekV4LM
from vertumnus.engine.fp8 import check_quantization, read_tensors
from vertumnus.engine.weights import require_all

# Parameters kept in fp32 (transformers' ``_keep_in_fp32_modules_strict``).
_FP32 = re.compile(
    r"(attn_hc|ffn_hc|hc_head|sinks|position_bias|e_score_correction_bias|q_a_norm|kv_norm"
    r"|input_layernorm|post_attention_layernorm|model\.norm)"
)
_PER_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def _empty(cfg: ModelConfig, dtype: torch.dtype, device: torch.device) -> DeepseekV4LM:
    with torch.device("meta"):
        model = DeepseekV4LM(cfg)
    model = model.to_empty(device=device).to(dtype)
    for name, tensor in _state(model).items():
        if _FP32.search(name) and tensor.is_floating_point():
            tensor.data = tensor.data.float()
    model.reset_expert_tokens()
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model


def _state(model: DeepseekV4LM) -> dict[str, torch.Tensor]:
    """Every loadable tensor: parameters and persistent buffers, by name."""
    out: dict[str, torch.Tensor] = dict(model.named_parameters())
    for name, buf in model.named_buffers():
        if not name.endswith("tokens_per_expert"):
            out[name] = buf
    return out


@torch.no_grad()
def random_dsv4(
    cfg: ModelConfig, seed: int, dtype: torch.dtype = torch.float32, device: str = "cpu"
) -> DeepseekV4LM:
    """Weights drawn from ``seed`` alone (``seed_tensors``)."""
    model = _empty(cfg, torch.float32, torch.device(device))
    seed_tensors(_state(model), cfg.num_experts, seed)
    return _cast(model, dtype).eval()


@torch.no_grad()
def seed_tensors(named: Mapping[str, torch.Tensor], num_experts: int, seed: int) -> None:
    """Draw a DeepSeek-V4's tensors (this engine's or transformers', which share their
    names) from ``seed``, in name order: matrices ~ N(0, 1/fan_in), embeddings ~ N(0, 1),
    norms and scales ~ 1 + N(0, 0.1^2), the small vectors (sinks, biases, bases) ~
    N(0, 0.3^2), the hash routers' table uniform over the experts; RoPE tables kept."""
    first = next(iter(named.values()))
    gen = torch.Generator(device=first.device).manual_seed(seed)
    for name, t in sorted(named.items()):
        if "inv_freq" in name:
            continue
        if name.endswith("tid2eid"):
            t.copy_(torch.randint(0, num_experts, t.shape, generator=gen, device=t.device))
            continue
        noise = torch.randn(t.shape, generator=gen, device=t.device)
        if "norm" in name or name.endswith("scale"):
            t.copy_(1.0 + 0.1 * noise)
        elif "embed" in name:
            t.copy_(noise)
        elif name.endswith(("sinks", "base", "bias")):
            t.copy_(0.3 * noise)
        else:
            t.copy_(noise / math.sqrt(t.shape[-1]))


def _cast(model: DeepseekV4LM, dtype: torch.dtype) -> DeepseekV4LM:
    for name, t in _state(model).items():
        if t.is_floating_point() and not _FP32.search(name):
            t.data = t.data.to(dtype)
    return model


@torch.no_grad()
def load_dsv4(
    cfg: ModelConfig, model_dir: str | Path, dtype: torch.dtype, device: torch.device
) -> DeepseekV4LM:
    """The model from a folder's ``.safetensors`` (module docstring)."""
    model_dir = Path(model_dir)
    model = _empty(cfg, dtype, device)
    state = _state(model)
    expected = set(state)
    if cfg.tie_word_embeddings:
        expected.discard("lm_head.weight")
    loaded: set[str] = set()
    for name, tensor, file in _tensors(model_dir):
        per_expert = _PER_EXPERT.match(name)
        if per_expert is not None:
            base, e, proj = per_expert.group(1), int(per_expert.group(2)), per_expert.group(3)
            i = cfg.moe_intermediate_size
            fused = state[f"{base}.{'down_proj' if proj == 'down_proj' else 'gate_up_proj'}"]
            dest = {"gate_proj": fused[e, :i], "up_proj": fused[e, i:], "down_proj": fused[e]}[proj]
            _copy(dest, tensor, name, file)
            loaded.add(f"{base}.{proj}.{e}")
            continue
        if name not in state:
            if name == "lm_head.weight" and cfg.tie_word_embeddings:
                continue
            raise ConfigError(
                f"{file}: unexpected tensor {name!r} for a DeepSeek-V4 of this config"
            )
        _copy(state[name], tensor, name, file)
        loaded.add(name)
    for name, t in state.items():  # experts given one by one count as the fused tensor
        if name.endswith((".experts.gate_up_proj", ".experts.down_proj")) and name not in loaded:
            base, kind = name.rsplit(".", 1)
            parts = ("gate_proj", "up_proj") if kind == "gate_up_proj" else ("down_proj",)
            if all(f"{base}.{p}.{e}" in loaded for e in range(t.shape[0]) for p in parts):
                loaded.add(name)
    require_all(model_dir, expected, loaded)
    return model.eval()


def _tensors(model_dir: Path) -> Iterator[tuple[str, torch.Tensor, str]]:
    """(name in transformers' naming, tensor, file) for every tensor the model needs:
    FP8 matrices dequantized, the MTP layer skipped."""
    raw = json.loads((model_dir / "config.json").read_text())
    block = check_quantization(raw)
    for stored in read_tensors(model_dir, block, skip=is_mtp):
        if stored.name.endswith("rotary_emb.inv_freq"):
            continue
        yield to_transformers(stored.name), stored.tensor, stored.file


def _copy(dest: torch.Tensor, tensor: torch.Tensor, name: str, file: str) -> None:
    if tuple(tensor.shape) != tuple(dest.shape):
        raise ConfigError(
            f"{file}: tensor {name!r} has shape {tuple(tensor.shape)}, "
            f"config.json implies {tuple(dest.shape)}"
        )
    dest.copy_(tensor.to(dest.dtype))
