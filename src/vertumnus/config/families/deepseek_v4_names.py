"""DeepSeek-V4's own tensor names -> transformers' (``DeepseekV4ForCausalLM``).

DeepSeek publishes V4 under the names of its reference code (``embed.weight``,
``layers.L.attn.wq_a.weight``, ``layers.L.ffn.experts.E.w1.weight``, ``hc_head_fn``,
``mtp.0....``); transformers renames them at load with the table in its
``conversion_mapping.py`` (key ``deepseek_v4``). ``NATIVE_RENAMES`` is that table
restated for ``re.sub``, with three differences, each a choice of this engine:

- routed experts stay one tensor per expert and projection, under the names the
  engine's loader already places (``mlp.experts.E.gate_proj.weight`` for ``w1``,
  ``up_proj`` for ``w3``, ``down_proj`` for ``w2``), where transformers stacks them
  into ``mlp.experts.gate_up_proj`` [E, 2I, H] (gate rows first) and ``down_proj``
  [E, H, I];
- the backbone's names get the ``model.`` prefix (transformers adds its
  ``base_model_prefix`` when the model has the name under it); ``lm_head.weight`` does not;
- the compressor norm's rename (transformers' ``.norm.`` -> ``.kv_norm.``) names the
  compressor, so that ``model.norm.weight`` is left alone: every name transformers
  uses for this model renames to itself, and a loader may apply the table to a
  ``save_pretrained`` folder and a native one alike.

FP8 scales (``X.scale``, ``X.weight_scale_inv``) are paired with their weights and
consumed before renaming (``engine/fp8.py``), so they have no entry here. The
multi-token-prediction layer (``mtp.*``; transformers ignores ``(^|\\.)mtp\\..*``) is
not needed for prefill: ``is_mtp`` tells a loader to skip it.

Owns the names only: not reading or dequantizing tensors (``engine/fp8.py``), not the
model (``engine/dsv4``), not reading ``config.json`` (``deepseek_v4.py``). Torch-free.
"""

from __future__ import annotations

import re

from vertumnus.config.families.common import Renames

# Applied in order, each with ``re.sub``; transformers' order where it has the rule.
NATIVE_RENAMES: Renames = (
    # Module paths (transformers' "general mid-key renames").
    (r"\.attn\.", ".self_attn."),
    (r"\.ffn\.", ".mlp."),
    (r"\.indexer\.compressor\.", ".compressor.indexer."),
    # Leaves.
    (r"^embed\.weight$", "embed_tokens.weight"),
    (r"^head\.weight$", "lm_head.weight"),
    (r"^hc_head_(fn|base|scale)$", r"hc_head.hc_\1"),
    (r"\.attn_norm\.", ".input_layernorm."),
    (r"\.ffn_norm\.", ".post_attention_layernorm."),
    (r"\.hc_(attn|ffn)_(fn|base|scale)$", r".\1_hc.\2"),
    (r"\.attn_sink$", ".sinks"),
    (r"\.indexer\.weights_proj\.", ".compressor.indexer.scorer.weights_proj."),
    (r"\.indexer\.wq_b\.", ".compressor.indexer.q_b_proj."),
    (r"(\.self_attn|\.compressor(?:\.indexer)?)\.norm\.", r"\1.kv_norm."),
    (r"\.ape$", ".position_bias"),
    (r"\.wq_a\.", ".q_a_proj."),
    (r"\.self_attn\.wq_b\.", ".self_attn.q_b_proj."),
    (r"\.wkv\.", ".kv_proj."),
    (r"\.wgate\.", ".gate_proj."),
    (r"\.wo_a\.", ".o_a_proj."),
    (r"\.wo_b\.", ".o_b_proj."),
    (r"\.q_norm\.", ".q_a_norm."),
    (r"\.gate\.bias$", ".gate.e_score_correction_bias"),
    (r"\.shared_experts\.w1\.", ".shared_experts.gate_proj."),
    (r"\.shared_experts\.w2\.", ".shared_experts.down_proj."),
    (r"\.shared_experts\.w3\.", ".shared_experts.up_proj."),
    # Routed experts, one tensor each (module docstring).
    (r"\.experts\.(\d+)\.w1\.", r".experts.\1.gate_proj."),
    (r"\.experts\.(\d+)\.w3\.", r".experts.\1.up_proj."),
    (r"\.experts\.(\d+)\.w2\.", r".experts.\1.down_proj."),
    # The backbone lives under ``model.``; the head does not.
    (r"^(?!model\.|lm_head\.)", "model."),
)

_COMPILED = tuple((re.compile(pattern), to) for pattern, to in NATIVE_RENAMES)
_MTP = re.compile(r"(^|\.)mtp\.")


def to_transformers(name: str) -> str:
    """``name`` (native or already transformers') under transformers' naming."""
    for pattern, to in _COMPILED:
        name = pattern.sub(to, name)
    return name


def is_mtp(name: str) -> bool:
    """Whether ``name`` belongs to the multi-token-prediction layer (``mtp.0....`` in
    DeepSeek's naming), which prefill does not use and the loader skips."""
    return _MTP.search(name) is not None
