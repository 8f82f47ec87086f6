"""transformers' Qwen3 / Qwen3-MoE on the engine's very tensors: the reference of the
exactness step and the baseline of the speed step.

Owns the translation of a ``ModelConfig`` into transformers' config and ``twin``:
transformers' model is built on the meta device (no memory), then every parameter
is assigned a tensor of the engine's model (``load_state_dict(assign=True)``): the
same storage, never a copy, so a 61 GB model is held once. Fused expert stacks
(transformers >= 5: ``experts.gate_up_proj`` [E, 2I, H], ``experts.down_proj``
[E, H, I], the engine's layout) are shared whole; per-expert projections
(transformers 4.x) are shared as views of them. The rotary embedding's buffers,
which no state dict carries, are built anew on the device. ``twin`` checks that
nothing is left on the meta device and that every parameter lives in the engine's
storage.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import torch
import transformers
from torch import Tensor, nn

from vertumnus.config import ModelConfig
from vertumnus.engine.model import CausalLM
from vertumnus.engine.transformers_config import hf_config

_PER_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def _engine_tensor(src: dict[str, Tensor], key: str, cfg: ModelConfig) -> Tensor:
    """The engine's tensor (or a view of it) for transformers' state-dict ``key``."""
    if key in src:
        return src[key]
    match = _PER_EXPERT.match(key)
    if match is None:
        raise KeyError(f"transformers' {key!r} has no counterpart in the engine's model")
    base, e, proj = match.group(1), int(match.group(2)), match.group(3)
    i = cfg.moe_intermediate_size
    if proj == "down_proj":
        return src[f"{base}.down_proj"][e]
    gate_up = src[f"{base}.gate_up_proj"][e]
    return gate_up[:i] if proj == "gate_proj" else gate_up[i:]


def twin(engine: CausalLM, experts: str | None = None) -> transformers.PreTrainedModel:
    """transformers' model of ``engine.config`` holding ``engine``'s tensors, in eval
    mode. ``experts``: transformers' experts implementation ("eager": its loop over
    experts; None: its default, grouped GEMMs where it can)."""
    cfg = engine.config
    cls = transformers.Qwen3MoeForCausalLM if cfg.is_moe else transformers.Qwen3ForCausalLM
    with torch.device("meta"):
        hf = cls(hf_config(cfg))
    if experts is not None and cfg.is_moe and hasattr(hf, "set_experts_implementation"):
        hf.set_experts_implementation(experts)
    src = engine.state_dict()
    state = {key: _engine_tensor(src, key, cfg) for key in hf.state_dict()}
    hf.load_state_dict(state, strict=True, assign=True)
    _rebuild_meta_buffers(hf, engine.device)
    _check_shared(hf, engine)
    return hf.eval()


def experts_implementation(hf: transformers.PreTrainedModel) -> str:
    return str(getattr(hf.config, "_experts_implementation", None) or "eager (per-expert modules)")


def _rebuild_meta_buffers(hf: nn.Module, device: torch.device) -> None:
    """Rotary embeddings derive their buffers from the config: build them again."""
    for name, module in list(hf.named_modules()):
        if not any(b.is_meta for b in module.buffers(recurse=False)):
            continue
        if not hasattr(module, "inv_freq"):
            raise RuntimeError(f"{name}: a buffer no state dict carries, left on the meta device")
        fresh = type(module)(config=module.config).to(device)
        parent, _, child = name.rpartition(".")
        setattr(hf.get_submodule(parent) if parent else hf, child, fresh)


def _check_shared(hf: nn.Module, engine: nn.Module) -> None:
    storages = {p.untyped_storage().data_ptr() for p in engine.parameters()}
    for name, tensor in [*hf.named_parameters(), *hf.named_buffers()]:
        if tensor.is_meta:
            raise RuntimeError(f"transformers' {name} is still on the meta device")
    copied = [
        name for name, p in hf.named_parameters() if p.untyped_storage().data_ptr() not in storages
    ]
    if copied:
        raise RuntimeError(f"transformers' parameters not in the engine's storage: {copied[:3]}")


@torch.inference_mode()
def logits(
    hf: transformers.PreTrainedModel, tokens: Sequence[int], device: torch.device, keep: int = 0
) -> Tensor:
    """transformers' fp32 logits of ``tokens`` (one sequence, no cache): every row, or
    the last ``keep``."""
    ids = torch.tensor([list(tokens)], dtype=torch.long, device=device)
    out = hf(input_ids=ids, use_cache=False, logits_to_keep=keep)
    return out.logits[0].float()
