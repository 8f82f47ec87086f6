"""FP8 block-scaled checkpoints (DeepSeek's layout), dequantized at load.

The layout, as DeepSeek publishes it and transformers' fine-grained FP8 integration
reads it: a matrix ``X.weight`` [out, in] is stored as ``float8_e4m3fn`` beside one
scale per block of ``weight_block_size`` (128 x 128), [ceil(out/128), ceil(in/128)],
named ``X.weight_scale_inv`` (V3, transformers) or ``X.scale`` (V4), in float32 or as
powers of two in ``float8_e8m0fnu`` (``scale_fmt = "ue8m0"``); the edge blocks are
partial. The weight is ``weight.float() * scale`` over each block. Everything else
(embeddings, norms, sinks, hyper-connection weights, V4's compressor and indexer
projections) is stored unscaled in bf16 or fp32 and passes through as stored.
``config.json`` says so: ``quantization_config = {"quant_method": "fp8", "fmt": "e4m3",
"weight_block_size": [128, 128], ...}``.

Refused, by name: FP4 experts (``expert_dtype = "fp4"``, DeepSeek-V4-Flash's and V4.1's
packed e2m1 with per-32 ``ue8m0`` scales, i.e. MXFP4), other quantization methods and
formats, static activation scales, per-tensor FP8 (no block size), a float8 weight
without its scale and a ``weight_scale_inv`` without its weight.

Weights are dequantized at load on every device: keeping FP8 on CUDA (``torch._scaled_mm``
with block scales) is not done here, as no GPU was lent to test it and dequantized bf16
is what runs everywhere.

Owns the FP8 format: the dequantization, its inverse (used by tests to write folders),
the config check, and reading a folder's tensors with scales paired across shards. Does
not own tensor names (``config/families/deepseek_v4_names.py``), placing tensors in the
model or the dtype they end in (``engine/weights.py``).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

import torch
from safetensors import safe_open

from vertumnus.config import ConfigError

FP8_MAX = 448.0  # the largest finite float8_e4m3fn
_SCALE_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float8_e8m0fnu)
_SCALE_SUFFIXES = (".weight_scale_inv", ".scale")  # X.weight's scale, V3's name first


def _grid(rows: int, cols: int, block: tuple[int, int]) -> tuple[int, int]:
    return math.ceil(rows / block[0]), math.ceil(cols / block[1])


def _expand_rows(scale: torch.Tensor, rows: int, block_rows: int) -> torch.Tensor:
    """[..., R, C] block scales -> [..., rows, C]: each block row repeated over its rows."""
    return scale.float().repeat_interleave(block_rows, dim=-2)[..., :rows, :]


def dequantize_blocks(
    weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]
) -> torch.Tensor:
    """fp32 ``weight.float() * scale_inv`` over blocks of ``block`` [rows, cols] of the
    last two dims; partial blocks at the bottom and right edges take their block's
    scale. ``scale_inv``: [..., ceil(rows/br), ceil(cols/bc)] in float32, bf16, fp16 or
    ``float8_e8m0fnu``; ValueError on any other dtype or shape."""
    if weight.dim() < 2:
        raise ValueError(f"FP8 weight must be a matrix, got shape {tuple(weight.shape)}")
    if scale_inv.dtype not in _SCALE_DTYPES:
        raise ValueError(
            f"unsupported FP8 scale dtype {scale_inv.dtype}; supported: float32, bfloat16, "
            "float16, float8_e8m0fnu"
        )
    rows, cols = weight.shape[-2:]
    expected = (*weight.shape[:-2], *_grid(rows, cols, block))
    if tuple(scale_inv.shape) != expected:
        raise ValueError(
            f"FP8 scale shape {tuple(scale_inv.shape)} does not fit weight shape "
            f"{tuple(weight.shape)} in blocks of {block}: expected {expected}"
        )
    out = weight.to(torch.float32, copy=True)  # scaled in place below
    scale = _expand_rows(scale_inv, rows, block[0])  # [..., rows, C]
    # Scale the full column blocks through a view of the weight (never a second
    # weight-sized tensor of scales), then the partial block on the right.
    full, rest = divmod(cols, block[1])
    blocks = out[..., : full * block[1]].view(*out.shape[:-1], full, block[1])
    blocks.mul_(scale[..., :full, None])
    if rest:
        out[..., full * block[1] :].mul_(scale[..., full:])
    return out


def quantize_blocks(
    weight: torch.Tensor, block: tuple[int, int], *, scale_dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn weight, scale_inv) such that ``dequantize_blocks`` approximates
    ``weight``: each block's scale is its largest magnitude / 448, as DeepSeek's
    reference quantizes (1 for an all-zero block); with ``scale_dtype =
    float8_e8m0fnu`` (``ue8m0``) the scale is rounded up to a power of two."""
    if weight.dim() < 2:
        raise ValueError(f"can only quantize matrices, got shape {tuple(weight.shape)}")
    rows, cols = weight.shape[-2:]
    grid_r, grid_c = _grid(rows, cols, block)
    w = weight.float()
    padded = torch.nn.functional.pad(w, (0, grid_c * block[1] - cols, 0, grid_r * block[0] - rows))
    tiles = padded.reshape(*w.shape[:-2], grid_r, block[0], grid_c, block[1])
    amax = tiles.abs().amax(dim=(-3, -1))  # [..., grid_r, grid_c]
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    if scale_dtype == torch.float8_e8m0fnu:
        scale = torch.exp2(torch.ceil(torch.log2(scale)))
    elif scale_dtype not in _SCALE_DTYPES:
        raise ValueError(f"unsupported FP8 scale dtype {scale_dtype}")
    scale = scale.to(scale_dtype)
    expanded = _expand_rows(scale, rows, block[0]).repeat_interleave(block[1], dim=-1)
    q = (w / expanded[..., :cols]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale


def check_quantization(raw_config: dict[str, Any]) -> tuple[int, int] | None:
    """The weight block size of an FP8 (e4m3, block-scaled) ``config.json``; None when
    it is not quantized; ConfigError naming what is not supported otherwise."""
    quant = raw_config.get("quantization_config")
    inner = quant if isinstance(quant, dict) else {}
    expert_dtype = inner.get("expert_dtype", raw_config.get("expert_dtype"))
    if expert_dtype not in (None, "fp8"):
        raise ConfigError(
            f"unsupported expert_dtype {expert_dtype!r}: FP4 (MXFP4, packed e2m1) experts "
            "are not supported; give an FP8 (e4m3) checkpoint, such as DeepSeek-V4-Flash-Base's "
            "layout, or bf16 weights"
        )
    if not quant:
        return None
    method = inner.get("quant_method")
    if method != "fp8":
        raise ConfigError(
            f"unsupported quantization_config quant_method {method!r}; supported: fp8 "
            "(e4m3 with block scales)"
        )
    fmt = inner.get("fmt", "e4m3")  # transformers' own FP8 configs do not write fmt
    if fmt != "e4m3":
        kind = " (FP4)" if fmt == "e2m1" else ""
        raise ConfigError(f"unsupported FP8 fmt {fmt!r}{kind}; supported: e4m3")
    scheme = inner.get("activation_scheme", "dynamic")
    if scheme != "dynamic":
        raise ConfigError(f"unsupported FP8 activation_scheme {scheme!r}; supported: dynamic")
    scale_fmt = inner.get("scale_fmt", "float")
    if scale_fmt not in ("float", "ue8m0"):
        raise ConfigError(f"unsupported FP8 scale_fmt {scale_fmt!r}; supported: float, ue8m0")
    size = inner.get("weight_block_size")
    if size is None:
        raise ConfigError(
            "FP8 quantization_config lacks weight_block_size: per-tensor FP8 is not supported"
        )
    if (
        not isinstance(size, (list, tuple))
        or len(size) != 2
        or not all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in size)
    ):
        raise ConfigError(f"FP8 weight_block_size must be two positive integers, got {size!r}")
    return int(size[0]), int(size[1])


class StoredTensor(NamedTuple):
    """One tensor of a checkpoint folder: the file that holds it, its stored name, and
    the tensor (dequantized to fp32 if it was FP8; as stored otherwise)."""

    file: str
    name: str
    tensor: torch.Tensor


def _files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        files = sorted({model_dir / f for f in weight_map.values()})
    else:
        files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"{model_dir}: no *.safetensors files")
    return files


def _headers(files: list[Path]) -> dict[str, tuple[Path, str]]:
    """Every tensor's file and stored dtype ("F8_E4M3", "BF16", ...), from the headers."""
    found: dict[str, tuple[Path, str]] = {}
    for path in files:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                if name in found:
                    raise ConfigError(
                        f"{path.name}: tensor {name!r} is also in {found[name][0].name}"
                    )
                found[name] = (path, f.get_slice(name).get_dtype())
    return found


def _pair_scales(
    found: dict[str, tuple[Path, str]], block: tuple[int, int] | None, skip: Callable[[str], bool]
) -> dict[str, str]:
    """weight name -> its scale's name, for every kept FP8 weight; ConfigError on a float8
    weight without a scale, a ``weight_scale_inv`` without its weight, FP4 or e5m2."""
    scales: dict[str, str] = {}
    for name, (path, _) in found.items():
        for suffix in _SCALE_SUFFIXES:
            if not name.endswith(suffix):
                continue
            weight = name.removesuffix(suffix) + ".weight"
            if skip(weight) or skip(name):
                break
            if weight not in found:
                if suffix == ".scale":  # e.g. transformers' ``attn_hc.scale``: not a scale
                    break
                raise ConfigError(f"{path.name}: FP8 scale {name!r} has no weight {weight!r}")
            dtype = found[weight][1]
            if dtype in ("I8", "U8"):
                raise ConfigError(
                    f"{found[weight][0].name}: {weight!r} is packed FP4 ({dtype} with a scale "
                    f"{name!r}): FP4 (MXFP4, e2m1) weights are not supported; give an FP8 "
                    "(e4m3) checkpoint or bf16 weights"
                )
            if dtype != "F8_E4M3":
                if suffix == ".scale":  # a tensor that happens to be named ``.scale``
                    break
                raise ConfigError(f"{path.name}: FP8 scale {name!r} belongs to {weight!r}, "
                                  f"which is stored as {dtype}, not float8_e4m3fn")  # fmt: skip
            if weight in scales:
                raise ConfigError(f"{path.name}: {weight!r} has two scales, "
                                  f"{scales[weight]!r} and {name!r}")  # fmt: skip
            scales[weight] = name
            break
    consumed = set(scales.values())
    for name, (path, dtype) in found.items():
        if skip(name) or name in consumed or not dtype.startswith("F8_"):
            continue
        if dtype != "F8_E4M3":
            raise ConfigError(f"{path.name}: {name!r} is {dtype}; supported FP8: e4m3 (F8_E4M3)")
        if block is None:
            raise ConfigError(
                f"{path.name}: {name!r} is FP8 but config.json has no quantization_config"
            )
        if name not in scales:
            raise ConfigError(
                f"{path.name}: float8 weight {name!r} has no scale "
                f"({name.removesuffix('.weight')}.weight_scale_inv or .scale)"
            )
    return scales


def read_tensors(
    model_dir: str | Path,
    block: tuple[int, int] | None,
    *,
    skip: Callable[[str], bool] | None = None,
) -> Iterator[StoredTensor]:
    """Every tensor of the folder's ``.safetensors`` files (those of
    ``model.safetensors.index.json`` if there is one), file by file, under its stored
    name: an FP8 weight dequantized with its scale (found in whichever file holds it),
    scales consumed, others as stored. ``block``: ``check_quantization``'s answer.
    ``skip(name)``: tensors never read (``deepseek_v4_names.is_mtp``), nor their scales.

    The folder is checked from the files' headers before this returns (ConfigError
    naming the file and tensor), so a bad checkpoint fails before any tensor is read."""
    model_dir = Path(model_dir)
    skipped = skip or (lambda _: False)
    found = _headers(_files(model_dir))
    scales = _pair_scales(found, block, skipped)
    consumed = set(scales.values())
    return _tensors(found, scales, consumed, block, skipped)


def _tensors(
    found: dict[str, tuple[Path, str]],
    scales: dict[str, str],
    consumed: set[str],
    block: tuple[int, int] | None,
    skip: Callable[[str], bool],
) -> Iterator[StoredTensor]:
    by_file: dict[Path, list[str]] = {}
    for name, (path, _) in found.items():
        if name not in consumed and not skip(name):
            by_file.setdefault(path, []).append(name)
    for path, names in by_file.items():
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in names:
                tensor = f.get_tensor(name)
                if name in scales:
                    assert block is not None  # _pair_scales refused FP8 without a block
                    scale_path = found[scales[name]][0]
                    if scale_path == path:
                        scale = f.get_tensor(scales[name])
                    else:
                        with safe_open(str(scale_path), framework="pt", device="cpu") as g:
                            scale = g.get_tensor(scales[name])
                    try:
                        tensor = dequantize_blocks(tensor, scale, block)
                    except ValueError as exc:
                        raise ConfigError(f"{path.name}: {name!r}: {exc}") from None
                yield StoredTensor(path.name, name, tensor)
