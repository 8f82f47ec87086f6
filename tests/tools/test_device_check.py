"""``tools/device_check.sh``: the dry run (the device check's every step on the CPU,
small shapes) as CI runs it, its JSON, table and measured profile; and the check's
arithmetic (the FLOPs of Qwen3-30B-A3B, the peak table, the layers that fit, the
profile's file name) without a process. No timing is asserted beyond being positive."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from support.tools import TOOLS, load_tool
from vertumnus.config import PRESETS
from vertumnus.perfmodel import Profile

STEPS = ("exactness", "prefill", "profile", "host_link", "rank")


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], str, Path]:
    """(the JSON, stdout, the out folder) of one dry run."""
    out = tmp_path_factory.mktemp("device-check")
    env = {**os.environ, "PYTHON": sys.executable}
    proc = subprocess.Popen(
        ["bash", str(TOOLS / "device_check.sh"), "--dry-run", "--out", str(out)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        start_new_session=True,
    )
    try:
        stdout, _ = proc.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise
    assert proc.returncode == 0, stdout[-4000:]
    return json.loads((out / "device_check.json").read_text()), stdout, out


@pytest.mark.multiproc
@pytest.mark.timeout(300)
def test_every_step_ran_and_cp_is_skipped_with_its_reason(
    dry_run: tuple[dict[str, Any], str, Path],
) -> None:
    report, _, _ = dry_run
    assert report["dry_run"] is True and report["device_type"] == "cpu"
    assert report["device"] and report["torch"] and report["transformers"]
    assert report["env"].startswith("found: ")
    for name in STEPS:
        step = report["steps"][name]
        assert step["status"] == "ok", (name, step.get("error"), step.get("traceback"))
        assert step["seconds"] >= 0
    cp = report["steps"]["cp"]
    assert cp["status"] == "skipped" and "NCCL" in cp["reason"]
    assert report["steps_ran"] is True
    assert report["peak"]["nominal"] is True


@pytest.mark.multiproc
@pytest.mark.timeout(300)
def test_exactness_passes_within_its_tolerances(dry_run: tuple[dict[str, Any], str, Path]) -> None:
    step = dry_run[0]["steps"]["exactness"]
    cases = step["cases"]
    assert {(c["model"], c["dtype"], c["prefix_len"] > 0) for c in cases} == {
        (m, d, p) for m in ("tiny", "tiny-moe") for d in ("float32", "bfloat16") for p in (0, 1)
    }
    for case in cases:
        assert case["passed"], case
        if case["dtype"] == "float32":
            assert case["max_abs_diff"] <= case["tolerance"] == 1e-4
        else:
            for name in case["held_to_rule"]:
                assert case[name] <= case[f"{name}_tolerance"]
            assert case["max_abs_diff_vs_transformers_bf16"] >= 0
    assert step["passed"] is True


@pytest.mark.multiproc
@pytest.mark.timeout(300)
def test_timings_and_bandwidths_are_positive(dry_run: tuple[dict[str, Any], str, Path]) -> None:
    report = dry_run[0]
    step = report["steps"]["prefill"]
    assert step["model"]["layers"] == 2 and not step["memory"]["reduced"]
    points = step["points"]
    assert [(p["tokens"], p["prefix"]) for p in points] == [
        (64, 0),
        (128, 0),
        (256, 0),
        (64, 128),
        (32, 224),
    ]
    for point in points:
        engine = point["engine"]
        assert engine["status"] == "ok" and len(engine["times_s"]) == 2
        assert min(engine["times_s"]) > 0 and engine["median_s"] > 0 and engine["mfu"] > 0
        assert point["flops"]["total"] > 0 and point["profile_e1_s"] > 0
        if not point["prefix"]:
            assert point["transformers"]["status"] == "ok"
            assert point["transformers"]["median_s"] > 0 and point["engine_speedup"] > 0
    link = report["steps"]["host_link"]
    for figure in (link["tier"]["d2h_bytes_s"], link["tier"]["h2d_bytes_s"]):
        assert figure > 0
    assert link["handoff"]["d2h_bytes_s"] > 0 and link["handoff"]["bytes"] > 0


@pytest.mark.multiproc
@pytest.mark.timeout(300)
def test_the_measured_profile_is_written_and_loads(
    dry_run: tuple[dict[str, Any], str, Path],
) -> None:
    report, _, out = dry_run
    step = report["steps"]["profile"]
    path = Path(step["path"])
    assert path == out / "qwen3-30b-a3b-cpu-measured.json" and path.is_file()
    profile = Profile.load(path)
    assert profile.degrees == [1] and profile.block_size == 16
    assert "degree 1 only" in profile.provenance["method"]
    assert profile.provenance["dry_run"] is True and len(profile.provenance["samples"]) == 5
    assert profile.predict(1, 1024, 0) > 0
    assert profile.host_link["d2h_bytes_s"] == report["steps"]["host_link"]["tier"]["d2h_bytes_s"]
    assert report["steps"]["host_link"]["written_into"] == str(path)


@pytest.mark.multiproc
@pytest.mark.timeout(300)
def test_the_table_lists_every_target(dry_run: tuple[dict[str, Any], str, Path]) -> None:
    report, stdout, _ = dry_run
    rows = {r["name"]: r for r in report["targets"]}
    assert rows["CP across ranks"]["result"] == "SKIP"
    assert rows["measured profile"]["result"] == "PASS"
    assert all(rows[n]["result"] == "PASS" for n in rows if n.startswith("exact "))
    assert rows["engine R=256"]["target"] == "MFU >= 50 %"
    assert rows["engine R=256"]["result"] == "SKIP"  # a nominal peak
    assert {rows[f"vs transformers R={n}"]["result"] for n in (64, 128, 256)} <= {"PASS", "FAIL"}
    assert all(r["result"] in ("PASS", "FAIL", "SKIP", "INFO") for r in rows.values())
    for row in report["targets"]:
        assert row["name"] in stdout
    assert report["summary"]["FAIL"] == sum(r["result"] == "FAIL" for r in report["targets"])


@pytest.mark.multiproc
@pytest.mark.timeout(300)
def test_the_rank_process_path_is_exact_with_and_without_a_prefix(
    dry_run: tuple[dict[str, Any], str, Path],
) -> None:
    runs = dry_run[0]["steps"]["rank"]["runs"]
    assert [r["cached_tokens"] > 0 for r in runs] == [False, True]
    for r in runs:
        assert r["passed"] and r["max_abs_diff"] <= 1e-4
        assert r["rank_compute_s"] > 0 and r["client_s"] > 0


@pytest.fixture(scope="module")
def model_math() -> ModuleType:
    return load_tool("device/model_math.py")


def test_flops_of_qwen3_30b_a3b_are_the_derived_profiles(model_math: ModuleType) -> None:
    cfg = replace(PRESETS["qwen3-30b-a3b-2l"], num_hidden_layers=48)
    # docs/gpu-profile.md: 56,885,248 active parameters per layer, 786,432 FLOPs a pair
    assert model_math.active_params_per_token(cfg) == 48 * 56_885_248
    flops = model_math.prefill_flops(cfg, 32768)
    assert flops["token_local"] == 2 * 48 * 56_885_248 * 32768
    assert flops["attention"] == 786_432 * 32768 * 32769 / 2
    assert flops["lm_head"] == 2 * 2048 * 151_936
    assert flops["total"] == flops["token_local"] + flops["attention"] + flops["lm_head"]
    assert model_math.prefill_flops(cfg, 1024, 2048)["attention"] == 786_432 * (
        1024 * 2048 + 1024 * 1025 / 2
    )


def test_layers_are_cut_to_what_fits(model_math: ModuleType) -> None:
    cfg = replace(PRESETS["qwen3-30b-a3b-2l"], num_hidden_layers=48)
    same, record = model_math.fit_layers(cfg, None, 32768, 32768, 512, 2)
    assert same == cfg and not record["reduced"]
    need = model_math.estimate(cfg, 32768, 32768, 512, 2)
    assert 60e9 < need["weights"] < 62e9  # about 30.5B parameters in bf16
    fits, record = model_math.fit_layers(cfg, need["total"], 32768, 32768, 512, 2)
    assert fits.num_hidden_layers == 48 and not record["reduced"]
    cut, record = model_math.fit_layers(cfg, need["total"] - 5 * 2**30, 32768, 32768, 512, 2)
    assert (
        40 <= cut.num_hidden_layers < 48 and record["reduced"] and "48 layers" in record["reason"]
    )
    with pytest.raises(MemoryError):
        model_math.fit_layers(cfg, 2**30, 32768, 32768, 512, 2)


def test_peaks_and_profile_names_by_device() -> None:
    common = load_tool("device/common.py")
    profile_fit = load_tool("device/profile_fit.py")
    assert common.peak_flops("NVIDIA H200", None, False)["flops_s"] == 989.4e12
    assert common.peak_flops("NVIDIA H100 80GB HBM3", None, False)["flops_s"] == 989.4e12
    assert common.peak_flops("NVIDIA H100 PCIe", None, False)["flops_s"] == 756e12
    assert common.peak_flops("NVIDIA A100-SXM4-80GB", None, False)["flops_s"] == 312e12
    assert common.peak_flops("NVIDIA L4", None, False)["flops_s"] is None
    assert common.peak_flops("NVIDIA L4", 121.0, False)["flops_s"] == 121e12
    assert common.peak_flops("cpu", None, True)["nominal"] is True
    names = {
        "NVIDIA H200": "h200",
        "NVIDIA H100 80GB HBM3": "h100",
        "NVIDIA H100 PCIe": "h100-pcie",
        "cpu-x86_64-unknown": "cpu",
    }
    for name, slug in names.items():
        assert profile_fit.gpu_slug(name) == slug


def test_random_weights_in_bf16_are_the_fp32_draw_rounded() -> None:
    """What the speed step builds on the GPU (``random_model(dtype=, device=)``): on the
    CPU, the default model's weights rounded, the tied LM head still tied."""
    import torch

    from vertumnus.engine.weights import random_model

    cfg = PRESETS["tiny-moe"]
    fp32 = random_model(cfg, 5)
    bf16 = random_model(cfg, 5, dtype=torch.bfloat16, device="cpu")
    assert bf16.lm_head.weight is bf16.model.embed_tokens.weight
    for (name, a), (_, b) in zip(fp32.named_parameters(), bf16.named_parameters(), strict=True):
        assert a.dtype == torch.float32 and b.dtype == torch.bfloat16, name
        assert torch.equal(a.to(torch.bfloat16), b), name
