"""The served model's shape: ``ModelConfig`` and the built-in presets.

A model config is read from a Hugging Face style ``config.json`` by the family its
``architectures`` name (``config/families/``: Qwen3, Llama, Mistral, Qwen2, Mixtral,
Qwen2-MoE, gpt-oss) or taken from a built-in preset (``tiny`` for tests and the CPU
demo, ``qwen3-0.6b-4l`` for benchmarks), whose weights are seeded random. A model's
``attention_mix`` is its layers' windows as the execution-time model counts them
(``perfmodel.AttentionMix``, which knows nothing of the configuration).
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vertumnus.config.families import SUPPORTED_ARCHITECTURES, family_of
from vertumnus.config.families.common import ROPE_TYPES
from vertumnus.config.families.deepseek_v4 import DeepseekV4Spec
from vertumnus.config.tables import ConfigError
from vertumnus.perfmodel import AttentionMix, Compressed

__all__ = ["PRESETS", "ModelConfig", "attention_mix", "resolve_model"]
ROUTERS = ("softmax_topk", "topk_softmax")
EXPERT_ACTS = ("swiglu", "clamped_swiglu")


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a decoder of one of the families (names follow transformers'
    ``Qwen3Config`` and, for the mixture-of-experts fields, ``Qwen3MoeConfig``;
    ``num_experts`` = 0: dense). The defaults are Qwen3's; a family's module says
    which fields differ for it."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    max_position_embeddings: int = 40_960
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # biases on q, k and v
    name: str = "custom"
    architecture: str = "Qwen3ForCausalLM"  # the family (``config/families``)
    o_proj_bias: bool = False
    qk_norm: bool = True  # per-head RMSNorm of q and k before RoPE (Qwen3)
    # RoPE: ``rope_type`` one of ``ROPE_TYPES`` with its scalar parameters
    # (factor, original_max_position_embeddings, ...), computed in ``engine/rope.py``.
    rope_type: str = "default"
    rope_params: tuple[tuple[str, float], ...] = ()
    # Sliding windows: query i sees keys i - sliding_window < j <= i on the layers whose
    # ``layer_types`` entry is "sliding_attention" (every layer when given and empty).
    sliding_window: int | None = None
    layer_types: tuple[str, ...] = ()
    attention_sinks: bool = False  # a learned logit per query head in each softmax
    # Mixture of experts (Qwen3-MoE): a layer is sparse when it is not in
    # ``mlp_only_layers`` and (layer + 1) % decoder_sparse_step == 0.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    # softmax_topk: softmax over all experts, then the top k (renormalised when
    # norm_topk_prob); topk_softmax: the top k logits, then a softmax over them.
    router: str = "softmax_topk"
    router_bias: bool = False
    expert_bias: bool = False  # biases on the experts' projections
    # swiglu: silu(gate) * up; clamped_swiglu (gpt-oss): ``engine/moe.py``.
    expert_act: str = "swiglu"
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE's gated shared expert; 0: none
    # DeepSeek-V4's own fields (``config/families/deepseek_v4.py``); None for the others.
    dsv4: DeepseekV4Spec | None = None

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def block_cache_problem(self, block_size: int) -> str | None:
        """Why the pool's paged blocks of ``block_size`` tokens cannot cache this
        model's prefixes, or None (every model but DeepSeek-V4 at some block sizes:
        ``DeepseekV4Spec.block_problem``)."""
        if self.dsv4 is None:
            return None
        return self.dsv4.block_problem(block_size, self.head_dim, self.sliding_window or 128)

    def caches_prefixes(self, block_size: int) -> bool:
        """Whether the pool's block cache holds this model's prefixes at ``block_size``
        (else its prefills compute every token of their prompts)."""
        return self.block_cache_problem(block_size) is None

    def window(self, layer: int) -> int | None:
        """The sliding window of ``layer`` in tokens; None: full causal attention."""
        if self.sliding_window is None:
            return None
        if self.layer_types and self.layer_types[layer] != "sliding_attention":
            return None
        return self.sliding_window

    @property
    def windows(self) -> tuple[int | None, ...]:
        return tuple(self.window(i) for i in range(self.num_hidden_layers))

    def rope_param(self, key: str, default: float | None = None) -> float | None:
        return dict(self.rope_params).get(key, default)

    def is_sparse_layer(self, layer: int) -> bool:
        return (
            self.num_experts > 0
            and layer not in self.mlp_only_layers
            and (layer + 1) % self.decoder_sparse_step == 0
        )

    @property
    def sparse_layers(self) -> list[int]:
        return [i for i in range(self.num_hidden_layers) if self.is_sparse_layer(i)]

    def __post_init__(self) -> None:
        for f in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            value = getattr(self, f)
            if not isinstance(value, int) or value <= 0:
                raise ConfigError(f"model config: {f} must be a positive integer, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ConfigError(
                "model config: num_attention_heads "
                f"({self.num_attention_heads}) must be a multiple of num_key_value_heads "
                f"({self.num_key_value_heads})"
            )
        if self.head_dim % 2 != 0:
            raise ConfigError(f"model config: head_dim must be even for RoPE, got {self.head_dim}")
        if not (self.rms_norm_eps > 0 and self.rope_theta > 0):
            raise ConfigError("model config: rms_norm_eps and rope_theta must be positive")
        if self.num_experts < 0:
            raise ConfigError(f"model config: num_experts must be >= 0, got {self.num_experts}")
        self._check_variants()
        if self.num_experts > 0:
            if not 0 < self.num_experts_per_tok <= self.num_experts:
                raise ConfigError(
                    "model config: num_experts_per_tok must lie in [1, num_experts], got "
                    f"{self.num_experts_per_tok} of {self.num_experts}"
                )
            if self.moe_intermediate_size <= 0 or self.decoder_sparse_step <= 0:
                raise ConfigError(
                    "model config: moe_intermediate_size and decoder_sparse_step must be "
                    "positive for a mixture-of-experts model"
                )

    def _check_variants(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ConfigError(
                f"model config: unsupported architecture {self.architecture!r}; supported: "
                f"{', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if self.rope_type not in ROPE_TYPES:
            raise ConfigError(f"model config: rope_type must be one of {ROPE_TYPES}")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ConfigError(
                f"model config: sliding_window must be >= 1, got {self.sliding_window}"
            )
        if self.layer_types and len(self.layer_types) != self.num_hidden_layers:
            raise ConfigError(
                f"model config: {len(self.layer_types)} layer_types for "
                f"{self.num_hidden_layers} layers"
            )
        if self.router not in ROUTERS or self.expert_act not in EXPERT_ACTS:
            raise ConfigError(
                f"model config: router must be one of {ROUTERS} and expert_act one of "
                f"{EXPERT_ACTS}, got {self.router!r} and {self.expert_act!r}"
            )
        if self.shared_expert_intermediate_size < 0:
            raise ConfigError("model config: shared_expert_intermediate_size must be >= 0")

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V per token over all layers, at 2 bytes per element (bf16)."""
        return self.kv_bytes(2)

    def kv_bytes(self, itemsize: int) -> int:
        """Bytes of K and V per token over all layers, at ``itemsize`` per element."""
        return self.num_hidden_layers * 2 * self.num_key_value_heads * self.head_dim * itemsize

    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any], name: str = "custom") -> ModelConfig:
        """Read a Hugging Face ``config.json`` by its family; reject what we cannot run."""
        family = family_of(raw)
        return cls(**family.read(raw), name=name, architecture=family.architecture)

    @classmethod
    def from_dir(cls, model_dir: str | os.PathLike[str]) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise ConfigError(f"{model_dir}: no config.json (expected a Hugging Face model folder)")
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{path}: not valid JSON: {exc}") from exc
        return cls.from_hf_dict(raw, name=Path(model_dir).name)


# Built-in presets, with seeded random weights. `tiny` is for tests and the CPU demo;
# `qwen3-0.6b-4l` is Qwen3-0.6B's shape cut to 4 layers, for benchmarks.
_TINY = ModelConfig(
    vocab_size=1024,
    hidden_size=128,
    intermediate_size=384,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    rope_theta=1_000_000.0,
    max_position_embeddings=65_536,
    tie_word_embeddings=True,
    name="tiny",
)
PRESETS: dict[str, ModelConfig] = {
    "tiny": _TINY,
    # `tiny` with a few small experts in every layer, for tests and the CPU demo.
    "tiny-moe": dataclasses.replace(
        _TINY,
        name="tiny-moe",
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        norm_topk_prob=True,
    ),
    # `tiny` as gpt-oss: sinks, a window of 128 on even layers, YaRN, 8 experts with
    # biases (top 2, clamped SwiGLU, top-k-then-softmax router): tests, a CPU profile.
    "tiny-gpt-oss": dataclasses.replace(
        _TINY,
        name="tiny-gpt-oss",
        architecture="GptOssForCausalLM",
        qk_norm=False,
        attention_bias=True,
        o_proj_bias=True,
        tie_word_embeddings=False,
        rope_theta=150_000.0,
        rope_type="yarn",
        rope_params=(
            ("factor", 32.0),
            ("original_max_position_embeddings", 4096.0),
            ("beta_fast", 32.0),
            ("beta_slow", 1.0),
            ("truncate", 0.0),
        ),
        sliding_window=128,
        layer_types=("sliding_attention", "full_attention") * 2,
        attention_sinks=True,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=128,
        router="topk_softmax",
        router_bias=True,
        expert_bias=True,
        expert_act="clamped_swiglu",
    ),
    # Qwen3-30B-A3B's layer shape (128 experts, top 8) cut to 2 layers: benchmarks.
    "qwen3-30b-a3b-2l": ModelConfig(
        vocab_size=151_936,
        hidden_size=2048,
        intermediate_size=6144,
        num_hidden_layers=2,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        rope_theta=1_000_000.0,
        max_position_embeddings=40_960,
        tie_word_embeddings=False,
        name="qwen3-30b-a3b-2l",
        num_experts=128,
        num_experts_per_tok=8,
        moe_intermediate_size=768,
        norm_topk_prob=True,
    ),
    "qwen3-0.6b-4l": ModelConfig(
        vocab_size=151_936,
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=4,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        rope_theta=1_000_000.0,
        max_position_embeddings=40_960,
        tie_word_embeddings=True,
        name="qwen3-0.6b-4l",
    ),
}


def attention_mix(model: ModelConfig) -> AttentionMix:
    """The mix of ``model``'s layers (``ModelConfig.windows``; DeepSeek-V4: its layer
    kinds, ``perfmodel.Compressed``, the indexer's score weighed as a pair by its
    heads x dims against attention's: 0.25 for V4-Flash)."""
    spec = model.dsv4
    if spec is None:
        return AttentionMix.of_windows(model.windows)
    window = model.sliding_window or 128
    weight = spec.index_n_heads * spec.index_head_dim / (model.num_attention_heads * model.head_dim)
    kinds: list[int | Compressed] = []
    for ratio in spec.compress_ratios:
        if not ratio:
            kinds.append(window)
        elif ratio == 4:  # CSA: the indexer's top k
            kinds.append(Compressed(window, ratio, spec.index_topk, weight))
        else:  # HCA: every entry
            kinds.append(Compressed(window, ratio, None, 0.0))
    return AttentionMix.of_layers(kinds)


def resolve_model(spec: str) -> tuple[ModelConfig, str | None]:
    """``spec`` is a preset name or a model folder; returns (config, folder or None)."""
    if spec in PRESETS:
        return PRESETS[spec], None
    if os.path.isdir(spec):
        return ModelConfig.from_dir(spec), spec
    raise ConfigError(
        f"--model {spec!r}: neither a built-in preset ({', '.join(sorted(PRESETS))}) "
        "nor a folder with config.json and *.safetensors"
    )


def eos_token_ids(model_dir: str | None) -> tuple[int, ...]:
    """``eos_token_id`` (an id or a list of ids) of the folder's
    ``generation_config.json``, else of its ``config.json``; () for a preset."""
    if model_dir is None:
        return ()
    for name in ("generation_config.json", "config.json"):
        path = Path(model_dir) / name
        if not path.is_file():
            continue
        try:
            raw: Any = json.loads(path.read_text()).get("eos_token_id")
        except (OSError, json.JSONDecodeError, AttributeError) as exc:
            raise ConfigError(f"{path}: cannot read eos_token_id: {exc}") from exc
        if raw is None:
            continue
        ids = raw if isinstance(raw, list) else [raw]
        if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
            raise ConfigError(f"{path}: eos_token_id must be an id or a list of ids, got {raw!r}")
        return tuple(ids)
    return ()
