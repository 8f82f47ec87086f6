"""Mixtral: Llama's attention (a sliding window when given), every layer a mixture of
experts whose size is ``intermediate_size``, top-k of a softmax router renormalised;
its checkpoints name the experts' projections w1 (gate), w3 (up) and w2 (down) under
``block_sparse_moe``."""

from __future__ import annotations

from typing import Any

from vertumnus.config.families.common import Family, experts, shape, windows


def read(raw: dict[str, Any]) -> dict[str, Any]:
    return {
        **shape(raw),
        **windows(raw),
        **experts(raw, "num_local_experts", "intermediate_size"),
        "qk_norm": False,
        "norm_topk_prob": True,
    }


FAMILY = Family(
    "MixtralForCausalLM",
    "mixtral",
    read,
    renames=(
        (r"\.block_sparse_moe\.experts\.(\d+)\.w1\.", r".mlp.experts.\1.gate_proj."),
        (r"\.block_sparse_moe\.experts\.(\d+)\.w3\.", r".mlp.experts.\1.up_proj."),
        (r"\.block_sparse_moe\.experts\.(\d+)\.w2\.", r".mlp.experts.\1.down_proj."),
        (r"\.block_sparse_moe\.gate\.", r".mlp.gate."),
    ),
)
