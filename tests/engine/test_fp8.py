"""FP8 block-scaled checkpoints in DeepSeek's layout (``engine/fp8.py``) and DeepSeek-V4's
native names (``config/families/deepseek_v4_names.py``): the dequantization against a
hand-expanded reference, its inverse within FP8's error, a two-shard folder written
here read back under transformers' names, the refusals, and the rename table against
a small random transformers ``DeepseekV4ForCausalLM`` and transformers' own renaming."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from vertumnus.config import ConfigError
from vertumnus.config.families.deepseek_v4_names import NATIVE_RENAMES, is_mtp, to_transformers
from vertumnus.engine.fp8 import (
    check_quantization,
    dequantize_blocks,
    quantize_blocks,
    read_tensors,
)

BLOCK = (128, 128)
FP8_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
              "weight_block_size": [128, 128]}  # fmt: skip


def _matrix(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Random values whose magnitude varies by row over six decades, so that blocks
    have very different scales."""
    gen = torch.Generator().manual_seed(seed)
    decades = torch.randint(-3, 3, (*shape[:-1], 1), generator=gen).float()
    return torch.randn(shape, generator=gen) * torch.pow(10.0, decades)


def _expanded(scale: torch.Tensor, rows: int, cols: int, block: tuple[int, int]) -> torch.Tensor:
    """The scale of every element, block by block, with Python loops."""
    out = torch.empty(*scale.shape[:-2], rows, cols)
    for i in range(scale.shape[-2]):
        for j in range(scale.shape[-1]):
            rs = slice(i * block[0], min((i + 1) * block[0], rows))
            cs = slice(j * block[1], min((j + 1) * block[1], cols))
            out[..., rs, cs] = scale[..., i, j, None, None].float()
    return out


@pytest.mark.parametrize("shape", [(256, 384), (200, 130), (130, 70), (5, 3), (2, 130, 260)])
@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.float8_e8m0fnu])
def test_round_trip_within_fp8_error(shape: tuple[int, ...], scale_dtype: torch.dtype) -> None:
    w = _matrix(shape, seed=sum(shape))
    q, scale = quantize_blocks(w, BLOCK, scale_dtype=scale_dtype)
    rows, cols = shape[-2:]
    grid = (math.ceil(rows / 128), math.ceil(cols / 128))
    assert q.dtype == torch.float8_e4m3fn and q.shape == w.shape
    assert scale.dtype == scale_dtype and tuple(scale.shape) == (*shape[:-2], *grid)
    s = _expanded(scale, rows, cols, BLOCK)
    assert (w.abs() <= 448.0 * s * (1 + 1e-6)).all()  # no block clamps
    back = dequantize_blocks(q, scale, BLOCK)
    assert back.dtype == torch.float32
    # e4m3: 3 mantissa bits, half an ulp is 2^-4 of a normal value; subnormals
    # (below 2^-6 before scaling) are spaced 2^-9 apart.
    bound = 2.0**-4 * w.abs() + 2.0**-10 * s
    assert ((back - w).abs() <= bound * (1 + 1e-5)).all()


def test_zero_block_scale_is_one() -> None:
    w = torch.zeros(130, 200)
    w[:128, 128:] = 3.0
    q, scale = quantize_blocks(w, BLOCK)
    assert torch.equal(scale[:, 0], torch.ones(2)) and scale[1, 1] == 1.0
    assert scale[0, 1] == torch.tensor(3.0) / 448.0  # fp32, as the reference computes it
    assert torch.equal(dequantize_blocks(q, scale, BLOCK), w)


@pytest.mark.parametrize(
    ("shape", "block", "scale_dtype"),
    [
        ((200, 130), (128, 128), torch.float32),
        ((100, 70), (64, 32), torch.float8_e8m0fnu),
        ((3, 96, 40), (32, 16), torch.bfloat16),
        ((127, 129), (128, 128), torch.float32),
    ],
)
def test_dequantize_equals_hand_expanded(
    shape: tuple[int, ...], block: tuple[int, int], scale_dtype: torch.dtype
) -> None:
    q, scale = quantize_blocks(_matrix(shape, seed=7), block, scale_dtype=scale_dtype)
    ref = q.float() * _expanded(scale, *shape[-2:], block)
    assert torch.equal(dequantize_blocks(q, scale, block), ref)
    as_fp32 = q.float()  # an fp32 weight is not scaled in place
    assert torch.equal(dequantize_blocks(as_fp32, scale, block), ref)
    assert torch.equal(as_fp32, q.float())


def test_dequantize_refuses_a_scale_of_the_wrong_shape_or_dtype() -> None:
    q, scale = quantize_blocks(_matrix((200, 130), seed=1), BLOCK)
    with pytest.raises(ValueError, match=r"scale shape \(1, 2\) .* \(200, 130\) .* \(2, 2\)"):
        dequantize_blocks(q, scale[:1], BLOCK)
    with pytest.raises(ValueError, match=re.escape("unsupported FP8 scale dtype torch.uint8")):
        dequantize_blocks(q, scale.to(torch.uint8), BLOCK)


# A DeepSeek-layout folder: native names, FP8 matrices, unscaled bf16/fp32 tensors, an
# MTP layer, scales named as V3 (``weight_scale_inv``) and V4 (``scale``) name them.
_FP8 = {  # native name -> (shape, scale suffix, scale dtype, shard of the scale)
    "layers.0.attn.wq_a.weight": ((200, 130), "weight_scale_inv", torch.float32, 2),
    "layers.0.ffn.experts.1.w1.weight": ((32, 64), "scale", torch.float8_e8m0fnu, 1),
    "head.weight": ((300, 64), "scale", torch.float32, 2),
    "mtp.0.ffn.experts.0.w2.weight": ((64, 32), "scale", torch.float32, 2),
}
_PLAIN = {  # native name -> (shape, dtype, shard)
    "embed.weight": ((300, 64), torch.bfloat16, 1),
    "layers.0.attn.compressor.wkv.weight": ((128, 64), torch.bfloat16, 1),
    "layers.0.attn_norm.weight": ((64,), torch.float32, 1),
    "hc_head_fn": ((2, 128), torch.float32, 2),
    "layers.1.attn.indexer.compressor.norm.weight": ((16,), torch.float32, 2),
    "layers.1.ffn.gate.bias": ((4,), torch.float32, 2),
    "mtp.0.norm.weight": ((64,), torch.float32, 1),
}
_SHARDS = {1: "model-00001-of-00002.safetensors", 2: "model-00002-of-00002.safetensors"}


def _write(folder: Path, shards: dict[int, dict[str, torch.Tensor]], index: bool = True) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    weight_map = {}
    for shard, tensors in shards.items():
        save_file(tensors, str(folder / _SHARDS[shard]))
        weight_map |= dict.fromkeys(tensors, _SHARDS[shard])
    if index:
        (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


def _deepseek_folder(folder: Path, index: bool = True) -> dict[str, torch.Tensor]:
    """Writes the folder; returns what a loader must get, under transformers' names."""
    shards: dict[int, dict[str, torch.Tensor]] = {1: {}, 2: {}}
    expected = {}
    for i, (name, (shape, suffix, scale_dtype, scale_shard)) in enumerate(_FP8.items()):
        q, scale = quantize_blocks(_matrix(shape, seed=i), BLOCK, scale_dtype=scale_dtype)
        shards[1][name] = q
        shards[scale_shard][name.removesuffix("weight") + suffix] = scale
        expected[to_transformers(name)] = dequantize_blocks(q, scale, BLOCK)
    for i, (name, (shape, dtype, shard)) in enumerate(_PLAIN.items()):
        shards[shard][name] = _matrix(shape, seed=100 + i).to(dtype)
        expected[to_transformers(name)] = shards[shard][name]
    _write(folder, shards, index)
    return {name: t for name, t in expected.items() if ".mtp." not in name}


@pytest.mark.parametrize("index", [True, False])
def test_deepseek_folder_reads_back_dequantized_under_transformers_names(
    tmp_path: Path, index: bool
) -> None:
    expected = _deepseek_folder(tmp_path, index)
    assert check_quantization({"quantization_config": FP8_CONFIG}) == BLOCK
    got = {}
    files = {}
    for file, name, tensor in read_tensors(tmp_path, BLOCK, skip=is_mtp):
        got[to_transformers(name)] = tensor
        files[name] = file
    assert sorted(got) == sorted(expected) == sorted([
        "lm_head.weight",
        "model.embed_tokens.weight",
        "model.hc_head.hc_fn",
        "model.layers.0.input_layernorm.weight",
        "model.layers.0.mlp.experts.1.gate_proj.weight",
        "model.layers.0.self_attn.compressor.kv_proj.weight",
        "model.layers.0.self_attn.q_a_proj.weight",
        "model.layers.1.mlp.gate.e_score_correction_bias",
        "model.layers.1.self_attn.compressor.indexer.kv_norm.weight",
    ])  # fmt: skip
    for name, tensor in expected.items():
        assert got[name].dtype == tensor.dtype, name
        assert torch.equal(got[name], tensor), name
    assert got["model.layers.0.self_attn.q_a_proj.weight"].dtype == torch.float32
    assert files["layers.0.attn.wq_a.weight"] == _SHARDS[1]  # its scale is in shard 2


def _fp8(shape: tuple[int, int] = (200, 130)) -> tuple[torch.Tensor, torch.Tensor]:
    return quantize_blocks(_matrix(shape, seed=3), BLOCK)


def test_a_float8_weight_without_its_scale_is_refused(tmp_path: Path) -> None:
    q, _ = _fp8()
    _write(tmp_path, {1: {"layers.0.attn.wq_a.weight": q}})
    with pytest.raises(
        ConfigError, match=re.escape("float8 weight 'layers.0.attn.wq_a.weight' has no scale")
    ):
        read_tensors(tmp_path, BLOCK)
    # ... unless it is skipped (the MTP layer's tensors are never read).
    assert list(read_tensors(tmp_path, BLOCK, skip=lambda name: "wq_a" in name)) == []


def test_a_scale_without_its_weight_is_refused(tmp_path: Path) -> None:
    q, scale = _fp8()
    _write(tmp_path, {1: {"layers.0.attn.wkv.weight": q.float()},
                      2: {"layers.0.attn.wq_a.weight_scale_inv": scale}})  # fmt: skip
    with pytest.raises(
        ConfigError,
        match=f"{_SHARDS[2]}: FP8 scale 'layers.0.attn.wq_a.weight_scale_inv' has no weight "
        "'layers.0.attn.wq_a.weight'",
    ):
        read_tensors(tmp_path, BLOCK)


def test_fp8_weights_need_a_quantization_config(tmp_path: Path) -> None:
    q, scale = _fp8()
    _write(tmp_path, {1: {"head.weight": q, "head.scale": scale}})
    with pytest.raises(
        ConfigError, match=re.escape("'head.weight' is FP8 but config.json has no quanti")
    ):
        read_tensors(tmp_path, None)


def test_a_scale_that_does_not_fit_its_weight_is_refused_naming_it(tmp_path: Path) -> None:
    q, scale = _fp8()
    _write(tmp_path, {1: {"head.weight": q, "head.scale": scale[:, :1].contiguous()}})
    with pytest.raises(ConfigError, match=r"'head.weight': FP8 scale shape \(2, 1\)"):
        list(read_tensors(tmp_path, BLOCK))


def test_packed_fp4_experts_are_refused(tmp_path: Path) -> None:
    packed = torch.zeros(32, 32, dtype=torch.int8)  # 64 e2m1 values per row
    scale = torch.ones(32, 2).to(torch.float8_e8m0fnu)  # one per 32 values
    _write(tmp_path, {1: {"layers.3.ffn.experts.0.w1.weight": packed,
                          "layers.3.ffn.experts.0.w1.scale": scale}})  # fmt: skip
    with pytest.raises(ConfigError, match=r"'layers.3.ffn.experts.0.w1.weight' is packed FP4"):
        read_tensors(tmp_path, BLOCK)


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"quantization_config": {**FP8_CONFIG, "expert_dtype": "fp4"}}, "expert_dtype 'fp4': FP4"),
        ({"quantization_config": FP8_CONFIG, "expert_dtype": "fp4"}, "expert_dtype 'fp4': FP4"),
        ({"quantization_config": {"quant_method": "awq", "bits": 4}}, "quant_method 'awq'"),
        ({"quantization_config": {"quant_method": "quark"}}, "quant_method 'quark'"),
        ({"quantization_config": {**FP8_CONFIG, "fmt": "e2m1"}}, r"fmt 'e2m1' \(FP4\)"),
        ({"quantization_config": {**FP8_CONFIG, "fmt": "e5m2"}}, "fmt 'e5m2'; supported: e4m3"),
        ({"quantization_config": {**FP8_CONFIG, "activation_scheme": "static"}}, "'static'"),
        ({"quantization_config": {**FP8_CONFIG, "scale_fmt": "ue4m3"}}, "scale_fmt 'ue4m3'"),
        ({"quantization_config": {**FP8_CONFIG, "weight_block_size": None}}, "per-tensor"),
        ({"quantization_config": {**FP8_CONFIG, "weight_block_size": [128]}}, "two positive"),
    ],
)
def test_check_quantization_refuses_by_name(raw: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        check_quantization(raw)


def test_check_quantization_accepts_fp8_block_configs() -> None:
    assert check_quantization({"vocab_size": 10}) is None
    assert check_quantization({"quantization_config": FP8_CONFIG, "expert_dtype": "fp8"}) == BLOCK
    v4_base = {**FP8_CONFIG, "scale_fmt": "ue8m0", "weight_block_size": [64, 32]}
    assert check_quantization({"quantization_config": v4_base}) == (64, 32)
    transformers_written = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    assert check_quantization({"quantization_config": transformers_written}) == BLOCK


# --- The names, against a small random transformers model -------------------------------

_TYPES = ("sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention")


@pytest.fixture(scope="module")
def tiny_v4() -> torch.nn.Module:
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    cfg = DeepseekV4Config(
        vocab_size=128, hidden_size=64, moe_intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=2, head_dim=64, q_lora_rank=32, o_groups=2, o_lora_rank=16,
        n_routed_experts=4, num_experts_per_tok=2, index_n_heads=2, index_head_dim=16,
        index_topk=8, hc_mult=2, sliding_window=8, layer_types=list(_TYPES),
        mlp_layer_types=["hash_moe", "moe", "moe"], partial_rotary_factor=0.25,
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
    )  # fmt: skip
    torch.manual_seed(0)
    return DeepseekV4ForCausalLM(cfg)


def _native_names(
    layer_types: tuple[str, ...], hashed: tuple[bool, ...], experts: int
) -> list[str]:
    """Every tensor of a V4 checkpoint in DeepSeek's naming (the MTP layer aside), written
    by hand from its reference module names."""
    names = ["embed.weight", "head.weight", "norm.weight",
             "hc_head_fn", "hc_head_base", "hc_head_scale"]  # fmt: skip
    compressor = ["ape", "wkv.weight", "wgate.weight", "norm.weight"]
    for i, kind in enumerate(layer_types):
        layer = f"layers.{i}."
        names += [layer + n for n in (
            "attn.attn_sink", "attn.wq_a.weight", "attn.q_norm.weight", "attn.wq_b.weight",
            "attn.wkv.weight", "attn.kv_norm.weight", "attn.wo_a.weight", "attn.wo_b.weight",
            "attn_norm.weight", "ffn_norm.weight", "ffn.gate.weight",
            "ffn.gate.tid2eid" if hashed[i] else "ffn.gate.bias",
            "ffn.shared_experts.w1.weight", "ffn.shared_experts.w2.weight",
            "ffn.shared_experts.w3.weight",
            *(f"hc_{b}_{p}" for b in ("attn", "ffn") for p in ("fn", "base", "scale")),
            *(f"ffn.experts.{e}.w{w}.weight" for e in range(experts) for w in (1, 2, 3)),
        )]  # fmt: skip
        if kind != "sliding_attention":
            names += [f"{layer}attn.compressor.{n}" for n in compressor]
        if kind == "compressed_sparse_attention":
            names += [f"{layer}attn.indexer.compressor.{n}" for n in compressor]
            names += [
                f"{layer}attn.indexer.wq_b.weight",
                f"{layer}attn.indexer.weights_proj.weight",
            ]
    return names


_PER_EXPERT = re.compile(r"\.experts\.\d+\.(gate_proj|up_proj|down_proj)\.weight$")


def _fused(name: str) -> str:
    """A per-expert name -> the stacked parameter transformers holds it in."""
    return _PER_EXPERT.sub(
        lambda m: ".experts." + ("down_proj" if m[1] == "down_proj" else "gate_up_proj"), name
    )


def test_native_names_rename_onto_the_transformers_model(tiny_v4: torch.nn.Module) -> None:
    state = tiny_v4.state_dict()
    native = _native_names(_TYPES, (True, False, False), experts=4)
    renamed = [to_transformers(n) for n in native]
    assert len(set(renamed)) == len(native)
    assert {_fused(n) for n in renamed} == set(state)
    assert "model.layers.1.mlp.experts.3.up_proj.weight" in renamed  # w3
    assert "model.layers.2.self_attn.compressor.indexer.kv_norm.weight" not in renamed  # HCA


def test_transformers_names_rename_to_themselves(tiny_v4: torch.nn.Module) -> None:
    for name in tiny_v4.state_dict():
        assert to_transformers(name) == name
    per_expert = "model.layers.0.mlp.experts.2.down_proj.weight"
    assert to_transformers(per_expert) == per_expert


def test_the_table_agrees_with_transformers_own_renaming(tiny_v4: torch.nn.Module) -> None:
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

    transforms = get_model_conversion_mapping(tiny_v4)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    state = tiny_v4.state_dict()
    for name in _native_names(_TYPES, (True, False, False), experts=4):
        theirs, _ = rename_source_key(name, renamings, converters, "model", state)
        assert _fused(to_transformers(name)) == theirs, name


def test_mtp_names() -> None:
    assert is_mtp("mtp.0.attn.wq_a.weight")
    assert is_mtp("model.mtp.1.norm.weight")
    assert not is_mtp("layers.0.attn.wq_a.weight")
    assert not is_mtp("layers.0.ffn.experts.0.w1.weight")
    assert all(isinstance(p, str) and isinstance(r, str) for p, r in NATIVE_RENAMES)
