"""Qwen3-MoE in the engine against transformers' ``Qwen3MoeForCausalLM`` on the same
random weights (built and saved here): fp32 logits within 1e-4 for C in {1, 2, 3}
with prefix reuse, both expert layouts a checkpoint may use, a clear error for any
other, and the experts' load balance."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from support.factories import make_tokens
from support.reference import hf_logits, make_hf_moe
from support.threads import ThreadWorker, cp_prefill
from vertumnus.config import PRESETS, ConfigError, ModelConfig
from vertumnus.engine.model import CausalLM, SparseMoeBlock, causal_attention
from vertumnus.engine.weights import load_model, random_model

VOCAB = 256
ATOL = 1e-4
CPU = torch.device("cpu")


@pytest.fixture(scope="module", params=[True, False], ids=["norm_topk", "raw_topk"])
def checkpoint(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[transformers.Qwen3MoeForCausalLM, Path]:
    hf = make_hf_moe(request.param)
    folder = tmp_path_factory.mktemp("moe")
    hf.save_pretrained(folder)
    return hf, folder


def ours(folder: Path) -> CausalLM:
    return load_model(ModelConfig.from_dir(folder), folder, torch.float32, CPU)


def test_config_reads_the_moe_fields(checkpoint: tuple[object, Path]) -> None:
    cfg = ModelConfig.from_dir(checkpoint[1])
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (8, 3, 24)
    assert cfg.mlp_only_layers == (1,) and cfg.sparse_layers == [0, 2]


@pytest.mark.parametrize("c", [1, 2, 3])
def test_logits_match_transformers_with_prefix_reuse(
    checkpoint: tuple[transformers.Qwen3MoeForCausalLM, Path], c: int
) -> None:
    hf, folder = checkpoint
    model = ours(folder)
    assert isinstance(model.model.layers[0].mlp, SparseMoeBlock)
    assert not isinstance(model.model.layers[1].mlp, SparseMoeBlock)
    cfg = model.config
    worker = ThreadWorker.make(c, cfg, blocks_per_rank=32)
    prefix = make_tokens(80, seed=1, vocab=VOCAB)  # 5 blocks: uneven shares for C = 2 and 3
    res = cp_prefill(model, worker, prefix)
    first, cached = res.logits, res.cmd.prefix_len
    ref_prefix = hf_logits(hf, prefix)
    assert cached == 0 and float((first - ref_prefix).abs().max()) < ATOL
    prompt = prefix + make_tokens(37, seed=2, vocab=VOCAB)
    res = cp_prefill(model, worker, prompt)
    logits, cached = res.logits, res.cmd.prefix_len
    assert cached == 80
    ref = hf_logits(hf, prompt)[cached:]
    diff = float((logits - ref).abs().max())
    assert diff < ATOL, f"max |logit difference| {diff:.3g}"
    assert int(logits[-1].argmax()) == int(ref[-1].argmax())


def test_fused_and_transposed_expert_layouts_load_the_same_weights(
    checkpoint: tuple[object, Path], tmp_path: Path
) -> None:
    _, folder = checkpoint
    reference = ours(folder)
    tensors = load_file(str(folder / "model.safetensors"))
    cfg = reference.config
    for transpose in (False, True):
        fused: dict[str, torch.Tensor] = {
            k: v for k, v in tensors.items() if ".mlp.experts." not in k
        }
        for layer in cfg.sparse_layers:
            base = f"model.layers.{layer}.mlp.experts"
            gate_up = torch.stack(
                [
                    torch.cat(
                        (
                            tensors[f"{base}.{e}.gate_proj.weight"],
                            tensors[f"{base}.{e}.up_proj.weight"],
                        )
                    )
                    for e in range(cfg.num_experts)
                ]
            )
            down = torch.stack(
                [tensors[f"{base}.{e}.down_proj.weight"] for e in range(cfg.num_experts)]
            )
            if transpose:
                gate_up, down = (
                    gate_up.transpose(1, 2).contiguous(),
                    down.transpose(1, 2).contiguous(),
                )
            fused[f"{base}.gate_up_proj"], fused[f"{base}.down_proj"] = gate_up, down
        out = tmp_path / f"fused-{transpose}"
        out.mkdir()
        (out / "config.json").write_text((folder / "config.json").read_text())
        save_file(fused, str(out / "model.safetensors"), metadata={"format": "pt"})
        model = ours(out)
        for (name, a), (_, b) in zip(
            reference.named_parameters(), model.named_parameters(), strict=True
        ):
            assert torch.equal(a, b), name


def test_an_unsupported_expert_layout_is_named(
    checkpoint: tuple[object, Path], tmp_path: Path
) -> None:
    _, folder = checkpoint
    tensors = load_file(str(folder / "model.safetensors"))
    broken = {k: v for k, v in tensors.items() if not k.startswith("model.layers.0.mlp.experts.")}
    broken["model.layers.0.mlp.experts.gate_up_proj"] = torch.zeros(8, 64, 16)
    (tmp_path / "config.json").write_text((folder / "config.json").read_text())
    save_file(broken, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ConfigError, match="unsupported expert layout"):
        ours(tmp_path)
    # One expert missing: named in the per-expert form.
    missing = {
        k: v for k, v in tensors.items() if k != "model.layers.2.mlp.experts.5.up_proj.weight"
    }
    save_file(missing, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(
        ConfigError, match=r"lacks tensors: model\.layers\.2\.mlp\.experts\.5\.up_proj"
    ):
        ours(tmp_path)


def test_expert_load_is_counted_per_sparse_layer() -> None:
    cfg = PRESETS["tiny-moe"]
    model = random_model(cfg, seed=0).eval()
    ids = torch.tensor(make_tokens(100, seed=3, vocab=VOCAB)) % cfg.vocab_size
    with torch.inference_mode():
        model(ids, torch.arange(100), causal_attention())
    counts = model.expert_tokens()
    assert counts is not None and sorted(counts) == cfg.sparse_layers == [0, 1, 2, 3]
    for per_expert in counts.values():
        assert len(per_expert) == cfg.num_experts
        assert sum(per_expert) == 100 * cfg.num_experts_per_tok
    assert all(sum(v) == 0 for v in (model.expert_tokens() or {}).values())  # reset


@pytest.mark.multiproc
@pytest.mark.timeout(120)
def test_prefill_command_reports_expert_tokens() -> None:
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "vertumnus",
            "prefill",
            "--dtype",
            "float32",
            "--model",
            "tiny-moe",
            "--cp",
            "2",
            "--prompt-len",
            "301",  # 173 computed tokens: 3 of padding on two ranks, not counted
            "--prefix-len",
            "128",
            "--check",
        ],
        capture_output=True,
        text=True,
        timeout=110,
    )
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout)
    assert out["max_abs_diff"] < ATOL
    experts = out["expert_tokens"]
    cfg = PRESETS["tiny-moe"]
    assert sorted(int(k) for k in experts) == cfg.sparse_layers
    # Every computed token of the last prefill, top-k assignments per sparse layer.
    for per_expert in experts.values():
        assert sum(per_expert) == out["computed_tokens"] * cfg.num_experts_per_tok
