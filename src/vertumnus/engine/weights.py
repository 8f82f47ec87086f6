"""Model construction: seeded random weights for presets, or a Hugging Face folder.

Owns the mapping from checkpoint tensors to ``CausalLM`` parameters and the
errors a user sees when a checkpoint does not fit. A family whose checkpoints name
tensors otherwise says how (``Family.renames``, applied to every name first: Mixtral's
``block_sparse_moe.experts.E.w1``, gpt-oss's ``mlp.router``). MoE experts load from
either layout a checkpoint may use: one tensor per expert and projection
(``mlp.experts.E.gate_proj.weight`` [I, H], ``up_proj`` [I, H], ``down_proj`` [H, I],
as transformers saves them) or fused (``mlp.experts.gate_up_proj`` [E, 2I, H] and
``mlp.experts.down_proj`` [E, H, I], the in-memory layout of newer transformers, or
their transposes [E, H, 2I] and [E, I, H]; when 2I = H a transpose cannot be told
apart, and the tensor is read in the transformers layout); gpt-oss's experts from its own
fused layout (``expert_layout = "gpt_oss"``: ``gate_up_proj`` [E, H, 2I] with gate and
up interleaved, ``down_proj`` [E, I, H], and their biases). Does not own the architecture
(``model.py``) or device placement policy beyond the ``device``/``dtype`` it is given.
"""

from __future__ import annotations

import functools
import json
import math
import re
from pathlib import Path

import torch
from safetensors import safe_open

from vertumnus.config import ConfigError, ModelConfig
from vertumnus.config.families import BY_ARCHITECTURE
from vertumnus.engine.model import CausalLM

# Tensors that checkpoints may carry but the model derives itself.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """``auto``: bf16 on CUDA, and on a CPU whose cores compute in bf16 natively
    (AVX-512 BF16 or AMX on x86, BF16 on Arm), where oneDNN's bf16 matmuls run
    2-2.5x faster than fp32 (docs/results.md); fp32 on any other CPU."""
    if name == "auto":
        native = device.type == "cuda" or cpu_computes_bf16()
        return torch.bfloat16 if native else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


_BF16_FLAGS = frozenset(("avx512_bf16", "amx_bf16", "bf16"))


@functools.cache
def cpu_computes_bf16() -> bool:
    """This CPU has bf16 arithmetic in hardware (its ``/proc/cpuinfo`` flags; False
    where there is no such file) and torch's oneDNN backend can use it."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    flags: set[str] = set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            flags.update(value.split())
    # torch leaves mkldnn.is_available unannotated.
    return bool(flags & _BF16_FLAGS) and torch.backends.mkldnn.is_available()  # type: ignore[no-untyped-call]


def random_model(
    cfg: ModelConfig,
    seed: int,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> CausalLM:
    """Model with weights drawn from ``seed`` alone (same on every rank); by default
    fp32 on CPU.

    Matrices ~ N(0, 1/fan_in), embeddings ~ N(0, 1), norm weights ~ 1 + N(0, 0.1^2):
    activations keep their scale, so logits are well separated in tests.

    ``dtype``, ``device``: the parameters are allocated there and the draws are made
    there, by a generator on ``device`` seeded with ``seed``, one parameter at a time
    in fp32 and rounded into the parameter: a large model (Qwen3-30B-A3B in bf16 on a
    GPU) never has an fp32 copy, only one fp32 parameter's draw at a time. The
    weights depend on the device's generator (CPU and CUDA draw different numbers);
    on CPU in fp32 they are those of ``random_model(cfg, seed)``, and another dtype
    gives them rounded.
    """
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    with torch.device("meta"):
        model = CausalLM(cfg)
    model = model.to(dtype).to_empty(device=dev)
    model.reset_expert_tokens()
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    gen = torch.Generator(device=dev).manual_seed(seed)

    def randn(shape: torch.Size) -> torch.Tensor:
        return torch.randn(shape, generator=gen, device=dev)

    with torch.no_grad():
        for name, param in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.1 * randn(param.shape))
            elif name.endswith("bias"):
                param.copy_(0.02 * randn(param.shape))
            elif "embed_tokens" in name:
                param.copy_(randn(param.shape))
            else:  # [out, in] matrices and [E, out, in] expert stacks
                fan_in = param.shape[-1]
                param.copy_(randn(param.shape) / math.sqrt(fan_in))
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


_PER_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def load_model(
    cfg: ModelConfig, model_dir: str | Path, dtype: torch.dtype, device: torch.device
) -> CausalLM:
    """Build the model from the ``.safetensors`` files of a Hugging Face folder."""
    model_dir = Path(model_dir)
    with torch.device("meta"):
        model = CausalLM(cfg)
    model = model.to_empty(device=device).to(dtype)
    model.reset_expert_tokens()
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    params = dict(model.named_parameters())
    # What must be loaded: whole parameters, and each expert's projections.
    expected: set[str] = set()
    for name, param in params.items():
        if name.endswith((".experts.gate_up_proj", ".experts.down_proj")):
            base = name.rsplit(".", 1)[0]
            parts = ("gate_proj", "up_proj") if name.endswith("gate_up_proj") else ("down_proj",)
            expected |= {f"{base}.{e}.{p}.weight" for e in range(param.shape[0]) for p in parts}
        else:
            expected.add(name)
    loaded: set[str] = set()
    family = BY_ARCHITECTURE[cfg.architecture]
    renames = [(re.compile(pattern), to) for pattern, to in family.renames]
    with torch.no_grad():
        for path in _safetensors_files(model_dir):
            with safe_open(str(path), framework="pt", device="cpu") as f:
                for stored in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                    if stored.endswith(_IGNORED_SUFFIXES):
                        continue
                    name = stored
                    for pattern, to in renames:
                        name = pattern.sub(to, name)
                    tensor = f.get_tensor(stored)
                    if family.expert_layout == "gpt_oss" and ".mlp.experts." in name:
                        loaded |= _place_gpt_oss(params, name, tensor, path.name, dtype)
                        continue
                    loaded |= _place(cfg, params, name, tensor, path.name, dtype)
    if cfg.tie_word_embeddings:
        loaded.add("lm_head.weight")  # shares embed_tokens.weight
    require_all(model_dir, expected, loaded)
    return model.eval()


def require_all(model_dir: Path, expected: set[str], loaded: set[str]) -> None:
    """Refuse a checkpoint that lacks some of the ``expected`` tensors, naming them."""
    missing = sorted(expected - loaded)
    if missing:
        shown = ", ".join(missing[:5]) + (
            f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        )
        raise ConfigError(f"{model_dir}: checkpoint lacks tensors: {shown}")


def _place(
    cfg: ModelConfig,
    params: dict[str, torch.nn.Parameter],
    name: str,
    tensor: torch.Tensor,
    file: str,
    dtype: torch.dtype,
) -> set[str]:
    """Copy one checkpoint tensor into the model; returns the names it satisfies."""
    i = cfg.moe_intermediate_size
    per_expert = _PER_EXPERT.match(name)
    if per_expert is not None:
        base, e, proj = per_expert.group(1), int(per_expert.group(2)), per_expert.group(3)
        target = params.get(f"{base}.{'down_proj' if proj == 'down_proj' else 'gate_up_proj'}")
        if target is None or e >= target.shape[0]:
            raise ConfigError(f"{file}: unexpected tensor {name!r} for this config's experts")
        dest = {
            "gate_proj": target[e, :i],
            "up_proj": target[e, i:],
            "down_proj": target[e],
        }[proj]
        _copy(dest, tensor, name, file, dtype)
        return {name}
    if name.endswith((".experts.gate_up_proj", ".experts.down_proj")) and name in params:
        target = params[name]
        if tuple(tensor.shape) != tuple(target.shape):
            flipped = (target.shape[0], target.shape[2], target.shape[1])
            if tuple(tensor.shape) != flipped or target.shape[1] == target.shape[2]:
                raise ConfigError(
                    f"{file}: unsupported expert layout: {name!r} has shape "
                    f"{tuple(tensor.shape)}; expected {tuple(target.shape)} (fused, as "
                    f"transformers holds it), {flipped} (transposed), or one tensor per expert"
                )
            tensor = tensor.transpose(1, 2)
        _copy(target, tensor, name, file, dtype)
        base = name.rsplit(".", 1)[0]
        parts = ("gate_proj", "up_proj") if name.endswith("gate_up_proj") else ("down_proj",)
        return {f"{base}.{e}.{p}.weight" for e in range(target.shape[0]) for p in parts}
    if name not in params:
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            return set()
        raise ConfigError(
            f"{file}: unexpected tensor {name!r} for a {cfg.architecture} of this config"
        )
    _copy(params[name], tensor, name, file, dtype)
    return {name}


def _place_gpt_oss(
    params: dict[str, torch.nn.Parameter],
    name: str,
    tensor: torch.Tensor,
    file: str,
    dtype: torch.dtype,
) -> set[str]:
    """One of gpt-oss's fused expert tensors, unpacked into the shared layout: gate and
    up de-interleaved (even columns gate, odd up) and each matrix transposed to [out,
    in]. Returns the names it satisfies (the per-expert ones for the matrices)."""
    base, _, kind = name.rpartition(".")
    target_name = {
        "gate_up_proj": "gate_up_proj",
        "down_proj": "down_proj",
        "gate_up_proj_bias": "gate_up_bias",
        "down_proj_bias": "down_bias",
    }.get(kind)
    target = None if target_name is None else params.get(f"{base}.{target_name}")
    if target is None:
        raise ConfigError(f"{file}: unexpected tensor {name!r} for gpt-oss's experts")
    if kind == "gate_up_proj":  # [E, H, 2I] interleaved -> [E, 2I, H], gate rows first
        tensor = torch.cat((tensor[..., 0::2], tensor[..., 1::2]), dim=-1).transpose(1, 2)
    elif kind == "gate_up_proj_bias":  # [E, 2I] interleaved -> [gate | up]
        tensor = torch.cat((tensor[..., 0::2], tensor[..., 1::2]), dim=-1)
    elif kind == "down_proj":  # [E, I, H] -> [E, H, I]
        tensor = tensor.transpose(1, 2)
    _copy(target, tensor, name, file, dtype)
    if kind in ("gate_up_proj", "down_proj"):
        parts = ("gate_proj", "up_proj") if kind == "gate_up_proj" else ("down_proj",)
        return {f"{base}.{e}.{p}.weight" for e in range(target.shape[0]) for p in parts}
    return {f"{base}.{target_name}"}


def _copy(
    dest: torch.Tensor, tensor: torch.Tensor, name: str, file: str, dtype: torch.dtype
) -> None:
    if tuple(tensor.shape) != tuple(dest.shape):
        raise ConfigError(
            f"{file}: tensor {name!r} has shape {tuple(tensor.shape)}, "
            f"config.json implies {tuple(dest.shape)}"
        )
    dest.copy_(tensor.to(dtype))


def build_model(
    cfg: ModelConfig,
    model_dir: str | Path | None,
    seed: int,
    dtype: torch.dtype,
    device: torch.device,
) -> CausalLM:
    """Preset (``model_dir is None``: seeded random weights) or checkpoint folder;
    DeepSeek-V4 is its own model (``engine/dsv4``)."""
    if cfg.dsv4 is not None:
        from vertumnus.engine.dsv4.load import load_dsv4, random_dsv4

        if model_dir is None:
            return random_dsv4(cfg, seed, dtype, str(device))  # type: ignore[return-value]
        return load_dsv4(cfg, model_dir, dtype, device)  # type: ignore[return-value]
    if model_dir is None:
        return random_model(cfg, seed).to(device=device, dtype=dtype).eval()
    return load_model(cfg, model_dir, dtype, device)
