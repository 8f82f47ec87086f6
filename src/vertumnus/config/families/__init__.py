"""The model families the engine serves, and how each reads its ``config.json``.

A family is one small module that states how its architecture differs from the shared
decoder (``engine/model.py``): which projections carry biases, whether q and k are
normed per head, its RoPE and its scaling, its sliding windows and attention sinks,
its MLP or mixture of experts and router, and the names its checkpoints give to
tensors the shared decoder names otherwise. Each module holds one ``Family``; this
registry picks one from ``config.json``'s ``architectures`` (else its
``model_type``). What a family's checkpoint asks for and the engine does not implement
(a RoPE type, a quantized checkpoint, an activation) is refused here, at load, with the
feature named: never served wrong.

    qwen3.py      Qwen3ForCausalLM, Qwen3MoeForCausalLM (q/k norm)
    llama.py      LlamaForCausalLM (rope scaling llama3, linear, dynamic)
    mistral.py    MistralForCausalLM (a sliding window on every layer, or none)
    qwen2.py      Qwen2ForCausalLM, Qwen2MoeForCausalLM (q/k/v biases; shared expert)
    mixtral.py    MixtralForCausalLM (every layer sparse, w1/w2/w3 experts)
    gpt_oss.py    GptOssForCausalLM (sinks, alternating windows, clamped SwiGLU, YaRN)

Torch-free: the coordinator and the CLI read a folder's family without the engine.
"""

from __future__ import annotations

from typing import Any

from vertumnus.config.families import deepseek_v4, gpt_oss, llama, mistral, mixtral, qwen2, qwen3
from vertumnus.config.families.common import Family, Renames
from vertumnus.config.tables import ConfigError

FAMILIES: tuple[Family, ...] = (
    *qwen3.FAMILIES,
    llama.FAMILY,
    mistral.FAMILY,
    *qwen2.FAMILIES,
    mixtral.FAMILY,
    gpt_oss.FAMILY,
    deepseek_v4.FAMILY,
)
BY_ARCHITECTURE = {f.architecture: f for f in FAMILIES}
BY_MODEL_TYPE = {f.model_type: f for f in FAMILIES}
SUPPORTED_ARCHITECTURES = tuple(BY_ARCHITECTURE)

__all__ = ["BY_ARCHITECTURE", "FAMILIES", "SUPPORTED_ARCHITECTURES", "Family", "Renames"]


def family_of(raw: dict[str, Any]) -> Family:
    """The family of a ``config.json``: its first architecture (each must be supported),
    else its ``model_type``."""
    archs = raw.get("architectures") or []
    if archs:
        unsupported = [a for a in archs if a not in BY_ARCHITECTURE]
        if unsupported:
            raise ConfigError(
                f"unsupported architecture {unsupported[0]!r}; supported: "
                f"{', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        return BY_ARCHITECTURE[archs[0]]
    model_type = raw.get("model_type")
    if model_type in BY_MODEL_TYPE:
        return BY_MODEL_TYPE[model_type]
    raise ConfigError(
        f"unsupported model_type {model_type!r} (no 'architectures' given); supported: "
        + ", ".join(f"{f.model_type} ({f.architecture})" for f in FAMILIES)
    )
