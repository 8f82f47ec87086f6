"""gpt-oss: biases on every attention projection and a learned sink logit per query
head in every layer's softmax; layers alternating sliding-window (even) and full
attention; YaRN RoPE; every layer a mixture of experts with biases, whose router takes
the top k of its logits (with a bias) and a softmax over those k, and whose experts
apply a clamped SwiGLU: ``(clamp(up, -l, l) + 1) * g * sigmoid(alpha * g)`` with
``g = min(gate, l)``. Its checkpoints fuse the experts as [E, H, 2I] with gate and up
interleaved (``expert_layout = "gpt_oss"``) and call the router ``mlp.router``.

OpenAI's published checkpoints ship MXFP4 experts (``quantization_config``); those are
refused at load (``common.refuse_common``): give the bf16 form."""

from __future__ import annotations

from typing import Any

from vertumnus.config.families.common import Family, experts, shape, windows


def read(raw: dict[str, Any]) -> dict[str, Any]:
    return {
        **shape(raw),
        **windows(raw, lambda i: i % 2 == 0),
        **experts(raw, "num_local_experts", "intermediate_size"),
        "qk_norm": False,
        "attention_bias": bool(raw.get("attention_bias", True)),
        "o_proj_bias": bool(raw.get("attention_bias", True)),
        "attention_sinks": True,
        "router": "topk_softmax",
        "router_bias": True,
        "expert_bias": True,
        "expert_act": "clamped_swiglu",
        "swiglu_alpha": float(raw.get("swiglu_alpha", 1.702)),
        "swiglu_limit": float(raw.get("swiglu_limit", 7.0)),
    }


FAMILY = Family(
    "GptOssForCausalLM",
    "gpt_oss",
    read,
    renames=((r"\.mlp\.router\.", r".mlp.gate."),),
    expert_layout="gpt_oss",
)
