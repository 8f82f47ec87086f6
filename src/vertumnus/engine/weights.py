"""Model construction: seeded random weights for presets, or a Hugging Face folder.

Owns the mapping from checkpoint tensors to ``Qwen3ForCausalLM`` parameters and the
errors a user sees when a checkpoint does not fit. Does not own the architecture
(``model.py``) or device placement policy beyond the ``device``/``dtype`` it is given.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors import safe_open

from vertumnus.config import ConfigError, ModelConfig
from vertumnus.engine.model import Qwen3ForCausalLM

# Tensors that checkpoints may carry but the model derives itself.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def random_model(cfg: ModelConfig, seed: int) -> Qwen3ForCausalLM:
    """fp32 model on CPU with weights drawn from ``seed`` alone (same on every rank).

    Matrices ~ N(0, 1/fan_in), embeddings ~ N(0, 1), norm weights ~ 1 + N(0, 0.1^2):
    activations keep their scale, so logits are well separated in tests.
    """
    with torch.device("meta"):
        model = Qwen3ForCausalLM(cfg)
    model = model.to_empty(device="cpu")
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.1 * torch.randn(param.shape, generator=gen))
            elif name.endswith("bias"):
                param.copy_(0.02 * torch.randn(param.shape, generator=gen))
            elif "embed_tokens" in name:
                param.copy_(torch.randn(param.shape, generator=gen))
            else:
                fan_in = param.shape[1]
                param.copy_(torch.randn(param.shape, generator=gen) / math.sqrt(fan_in))
    return model


def _safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        return sorted({model_dir / f for f in weight_map.values()})
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"{model_dir}: no *.safetensors files")
    return files


def load_model(
    cfg: ModelConfig, model_dir: str | Path, dtype: torch.dtype, device: torch.device
) -> Qwen3ForCausalLM:
    """Build the model from the ``.safetensors`` files of a Hugging Face folder."""
    model_dir = Path(model_dir)
    with torch.device("meta"):
        model = Qwen3ForCausalLM(cfg)
    model = model.to_empty(device=device).to(dtype)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    params = dict(model.named_parameters())
    expected = set(params)
    loaded: set[str] = set()
    with torch.no_grad():
        for path in _safetensors_files(model_dir):
            with safe_open(str(path), framework="pt", device="cpu") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                    if name.endswith(_IGNORED_SUFFIXES):
                        continue
                    if name not in params:
                        if name == "lm_head.weight" and cfg.tie_word_embeddings:
                            continue
                        raise ConfigError(
                            f"{path.name}: unexpected tensor {name!r} "
                            "for a Qwen3 decoder of this config"
                        )
                    tensor = f.get_tensor(name)
                    if tuple(tensor.shape) != tuple(params[name].shape):
                        raise ConfigError(
                            f"{path.name}: tensor {name!r} has shape {tuple(tensor.shape)}, "
                            f"config.json implies {tuple(params[name].shape)}"
                        )
                    params[name].copy_(tensor.to(dtype))
                    loaded.add(name)
    if cfg.tie_word_embeddings:
        loaded.add("lm_head.weight")  # shares embed_tokens.weight
    missing = sorted(expected - loaded)
    if missing:
        shown = ", ".join(missing[:5]) + (
            f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        )
        raise ConfigError(f"{model_dir}: checkpoint lacks tensors: {shown}")
    return model.eval()


def build_model(
    cfg: ModelConfig,
    model_dir: str | Path | None,
    seed: int,
    dtype: torch.dtype,
    device: torch.device,
) -> Qwen3ForCausalLM:
    """Preset (``model_dir is None``: seeded random weights) or checkpoint folder."""
    if model_dir is None:
        return random_model(cfg, seed).to(device=device, dtype=dtype).eval()
    return load_model(cfg, model_dir, dtype, device)
