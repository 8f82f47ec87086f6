"""Model and engine configuration, and loading Hugging Face checkpoints.

The checkpoint tests write a tiny ``Qwen3ForCausalLM`` with transformers (the trusted
implementation), load it with ``load_model`` and compare logits on the same tokens.
"""

from __future__ import annotations

import json
import math
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from safetensors.torch import load_file

from support.factories import make_tokens
from support.reference import edit_tensors, hf_config
from vertumnus.config import (
    PRESETS,
    ConfigError,
    EngineConfig,
    ModelConfig,
    resolve_model,
)
from vertumnus.engine.model import causal_attention
from vertumnus.engine.weights import load_model

CPU = torch.device("cpu")
LOGITS_ATOL = 1e-4  # fp32 against fp32

# Grouped-query attention, and head_dim (24) != hidden_size / heads (16).
HF_SHAPE: dict[str, Any] = dict(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=24,
    rms_norm_eps=1e-6,
    max_position_embeddings=2048,
)
ROPE_THETA = 500_000.0
_DROP = object()  # hf_dict(field=_DROP) leaves the field out


def hf_dict(**overrides: Any) -> dict[str, Any]:
    """A transformers 5 style Qwen3 ``config.json`` as a dict."""
    raw: dict[str, Any] = {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        **HF_SHAPE,
        "rope_parameters": {"rope_type": "default", "rope_theta": ROPE_THETA},
        "tie_word_embeddings": False,
        "attention_bias": False,
        "use_sliding_window": False,
        "sliding_window": None,
    }
    raw.update(overrides)
    return {k: v for k, v in raw.items() if v is not _DROP}


# -- ModelConfig.from_hf_dict ----------------------------------------------------------


def test_reads_transformers_5_rope_parameters() -> None:
    cfg = ModelConfig.from_hf_dict(hf_dict(), name="t5style")
    assert cfg == ModelConfig(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=24,
        rms_norm_eps=1e-6,
        rope_theta=ROPE_THETA,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        attention_bias=False,
        name="t5style",
    )


def test_reads_older_top_level_rope_theta() -> None:
    raw = hf_dict(rope_parameters=_DROP, rope_theta=123_456.0, rope_scaling=None)
    assert ModelConfig.from_hf_dict(raw).rope_theta == 123_456.0


def test_rope_theta_defaults_to_ten_thousand() -> None:
    assert ModelConfig.from_hf_dict(hf_dict(rope_parameters=_DROP)).rope_theta == 10_000.0


def test_optional_fields_take_their_defaults() -> None:
    raw = hf_dict(
        architectures=_DROP,  # model_type alone identifies a Qwen3
        num_key_value_heads=_DROP,
        head_dim=None,
        rms_norm_eps=_DROP,
        max_position_embeddings=_DROP,
        tie_word_embeddings=_DROP,
        attention_bias=_DROP,
    )
    cfg = ModelConfig.from_hf_dict(raw)
    assert (cfg.num_key_value_heads, cfg.head_dim) == (4, 16)  # heads, hidden / heads
    assert (cfg.rms_norm_eps, cfg.max_position_embeddings) == (1e-6, 40_960)
    assert (cfg.tie_word_embeddings, cfg.attention_bias) == (False, False)


def test_reads_what_transformers_writes() -> None:
    hf = transformers.Qwen3Config(**HF_SHAPE, rope_theta=ROPE_THETA, tie_word_embeddings=True)
    raw = json.loads(json.dumps(hf.to_dict()))
    raw["architectures"] = ["Qwen3ForCausalLM"]
    cfg = ModelConfig.from_hf_dict(raw)
    assert cfg == ModelConfig(**HF_SHAPE, rope_theta=ROPE_THETA, tie_word_embeddings=True)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"architectures": ["PhiForCausalLM"]}, "unsupported architecture 'PhiForCausalLM'"),
        (
            {"architectures": ["Qwen3ForCausalLM", "Phi3ForCausalLM"]},
            "unsupported architecture 'Phi3ForCausalLM'",
        ),
        (
            {"architectures": ["Qwen3MoeForCausalLM"], "num_experts_per_tok": 2},
            "config.json lacks MoE fields: num_experts, moe_intermediate_size",
        ),
        (
            {
                "architectures": ["Qwen3MoeForCausalLM"],
                "num_local_experts": 4,
                "num_experts_per_tok": 5,
                "moe_intermediate_size": 8,
            },
            "num_experts_per_tok must lie in [1, num_experts]",
        ),
        ({"architectures": _DROP, "model_type": "phi"}, "unsupported model_type 'phi'"),
        ({"architectures": [], "model_type": _DROP}, "unsupported model_type None"),
        (
            {"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e6, "factor": 4.0}},
            "unsupported RoPE type 'longrope'",
        ),
        (
            {"rope_parameters": _DROP, "rope_scaling": {"type": "su", "factor": 2.0}},
            "unsupported RoPE type 'su'",
        ),
        (
            {
                "layer_types": ["chunked_attention"] * 2,
                "use_sliding_window": True,
                "sliding_window": 64,
            },
            "unsupported layer_types ['chunked_attention']",
        ),
        ({"quantization_config": {"quant_method": "fp8"}}, "quant_method 'fp8'"),
        ({"vocab_size": _DROP}, "lacks required fields: vocab_size"),
        (
            {"hidden_size": _DROP, "num_hidden_layers": _DROP},
            "lacks required fields: hidden_size, num_hidden_layers",
        ),
        ({"num_attention_heads": _DROP}, "lacks required fields: num_attention_heads"),
        ({"intermediate_size": _DROP}, "lacks required fields: intermediate_size"),
        ({"num_attention_heads": 6, "num_key_value_heads": 4}, "must be a multiple of"),
        ({"head_dim": 25}, "head_dim must be even"),
        ({"vocab_size": 0}, "vocab_size must be a positive integer"),
        ({"num_hidden_layers": 2.5}, "num_hidden_layers must be a positive integer"),
        ({"rms_norm_eps": 0.0}, "must be positive"),
    ],
)
def test_from_hf_dict_rejects(overrides: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        ModelConfig.from_hf_dict(hf_dict(**overrides))


def test_config_error_is_a_value_error() -> None:
    assert issubclass(ConfigError, ValueError)


def test_from_dir_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=re.escape("no config.json")):
        ModelConfig.from_dir(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        ModelConfig.from_dir(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(hf_dict()))
    assert ModelConfig.from_dir(tmp_path).name == tmp_path.name


def test_resolve_model(tmp_path: Path) -> None:
    assert resolve_model("tiny") == (PRESETS["tiny"], None)
    (tmp_path / "config.json").write_text(json.dumps(hf_dict()))
    cfg, folder = resolve_model(str(tmp_path))
    assert (cfg.hidden_size, folder) == (64, str(tmp_path))
    with pytest.raises(ConfigError, match="neither a built-in preset"):
        resolve_model(str(tmp_path / "absent"))


# -- EngineConfig ----------------------------------------------------------------------


def test_engine_config_defaults_are_valid() -> None:
    cfg = EngineConfig()
    assert cfg.to_dict()["block_size"] == 16
    assert EngineConfig(block_size=1, kv_blocks_per_rank=0, threads_per_rank=1).block_size == 1


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"block_size": 0}, "block_size must be a power of two"),
        ({"block_size": -16}, "block_size must be a power of two"),
        ({"block_size": 24}, "block_size must be a power of two"),
        ({"kv_blocks_per_rank": -1}, "kv_blocks_per_rank must be >= 0"),
        ({"device": "tpu"}, "device must be auto, cpu or cuda"),
        ({"dtype": "float64"}, "dtype must be auto"),
        ({"threads_per_rank": 0}, "threads_per_rank must be positive"),
        ({"rank_timeout_s": 0.0}, "rank_timeout_s must be positive"),
        ({"rank_timeout_s": math.inf}, "rank_timeout_s must be positive"),
        ({"rank_timeout_s": math.nan}, "rank_timeout_s must be positive"),
    ],
)
def test_engine_config_rejects(overrides: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        EngineConfig(**overrides)


# -- load_model against transformers -----------------------------------------------------


def write_checkpoint(path: Path, tied: bool, seed: int) -> transformers.Qwen3ForCausalLM:
    """Save a tiny transformers Qwen3 with weights far from its 0.02-std default init
    (which makes every logit nearly equal and a comparison weak); return it."""
    torch.manual_seed(seed)
    hf_cfg = hf_config(tied, rope_theta=ROPE_THETA, **HF_SHAPE)
    hf = transformers.Qwen3ForCausalLM(hf_cfg).float().eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(0.5 * torch.randn(p.shape, generator=gen))
    hf.save_pretrained(path)
    return hf


@pytest.fixture(scope="module", params=[True, False], ids=["tied", "untied"])
def checkpoint(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, transformers.Qwen3ForCausalLM]:
    tied: bool = request.param
    path = tmp_path_factory.mktemp("tied" if tied else "untied")
    return path, write_checkpoint(path, tied, seed=11 if tied else 12)


def edited_copy(src: Path, dst: Path, edit: Callable[[dict[str, torch.Tensor]], object]) -> Path:
    """Copy a checkpoint folder, applying ``edit`` to its tensor dict."""
    shutil.copytree(src, dst)
    edit_tensors(dst, edit)
    return dst


def test_load_model_matches_transformers(
    checkpoint: tuple[Path, transformers.Qwen3ForCausalLM],
) -> None:
    path, hf = checkpoint
    cfg = ModelConfig.from_dir(path)
    assert cfg.rope_theta == ROPE_THETA
    model = load_model(cfg, path, torch.float32, CPU)
    assert not model.training
    if cfg.tie_word_embeddings:
        assert model.lm_head.weight is model.model.embed_tokens.weight
    else:
        assert not torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)
    tokens = make_tokens(45, seed=8, vocab=cfg.vocab_size)
    ids = torch.tensor(tokens)
    with torch.no_grad():
        want = hf(input_ids=ids[None], use_cache=False).logits[0].float()
        got = model.logits(model(ids, torch.arange(len(tokens)), causal_attention()))
    assert got.shape == (45, cfg.vocab_size)
    assert want.std() > 1.0  # logits far apart: the comparison means something
    torch.testing.assert_close(got, want, rtol=0, atol=LOGITS_ATOL)


def test_load_model_accepts_lm_head_in_a_tied_checkpoint(tmp_path: Path) -> None:
    # Older writers saved lm_head.weight even when tied: it is the embedding, skipped.
    src = tmp_path / "src"
    write_checkpoint(src, tied=True, seed=13)

    def add_lm_head(t: dict[str, torch.Tensor]) -> None:
        t["lm_head.weight"] = t["model.embed_tokens.weight"].clone()

    path = edited_copy(src, tmp_path / "with_head", add_lm_head)
    cfg = ModelConfig.from_dir(path)
    model = load_model(cfg, path, torch.float32, CPU)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    torch.testing.assert_close(
        model.model.embed_tokens.weight,
        load_file(src / "model.safetensors")["model.embed_tokens.weight"],
    )


def test_load_model_rejects_a_missing_tensor(tmp_path: Path) -> None:
    src = tmp_path / "src"
    write_checkpoint(src, tied=False, seed=14)

    def drop(t: dict[str, torch.Tensor]) -> None:
        del t["model.layers.1.mlp.up_proj.weight"]

    path = edited_copy(src, tmp_path / "missing", drop)
    with pytest.raises(ConfigError, match=r"lacks tensors: model\.layers\.1\.mlp\.up_proj\.weight"):
        load_model(ModelConfig.from_dir(path), path, torch.float32, CPU)


def test_load_model_rejects_an_untied_checkpoint_without_lm_head(tmp_path: Path) -> None:
    src = tmp_path / "src"
    write_checkpoint(src, tied=False, seed=15)
    path = edited_copy(src, tmp_path / "no_head", lambda t: t.pop("lm_head.weight"))
    with pytest.raises(ConfigError, match=r"lacks tensors: lm_head\.weight"):
        load_model(ModelConfig.from_dir(path), path, torch.float32, CPU)


def test_load_model_rejects_a_tensor_of_the_wrong_shape(tmp_path: Path) -> None:
    src = tmp_path / "src"
    write_checkpoint(src, tied=True, seed=16)
    name = "model.layers.0.self_attn.k_proj.weight"  # [Hkv * D, hidden] = [48, 64]

    def reshape(t: dict[str, torch.Tensor]) -> None:
        t[name] = torch.zeros(32, 64)

    path = edited_copy(src, tmp_path / "bad_shape", reshape)
    with pytest.raises(
        ConfigError, match=r"k_proj\.weight' has shape \(32, 64\), config\.json implies \(48, 64\)"
    ):
        load_model(ModelConfig.from_dir(path), path, torch.float32, CPU)


def test_load_model_rejects_an_unexpected_tensor(tmp_path: Path) -> None:
    src = tmp_path / "src"
    write_checkpoint(src, tied=True, seed=17)

    def add(t: dict[str, torch.Tensor]) -> None:
        t["model.layers.2.mlp.up_proj.weight"] = torch.zeros(96, 64)  # a third layer

    path = edited_copy(src, tmp_path / "extra", add)
    with pytest.raises(
        ConfigError, match=re.escape("unexpected tensor 'model.layers.2.mlp.up_proj.weight'")
    ):
        load_model(ModelConfig.from_dir(path), path, torch.float32, CPU)


def test_load_model_rejects_a_folder_without_safetensors(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(hf_dict()))
    with pytest.raises(ConfigError, match=re.escape("no *.safetensors files")):
        load_model(ModelConfig.from_dir(tmp_path), tmp_path, torch.float32, CPU)
