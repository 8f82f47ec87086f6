"""Step 3: a measured degree-1 profile from the speed step's timings.

E_1(R, P) = d + (a + c)*R + b*P + alpha*W(R, P) is fitted by the project's own fit
(``perfmodel.fit_profile``: non-negative least squares on relative error, the whole
per-token term reported as ``c``) to the engine's median time at every point the
speed step timed (the lengths without a prefix and the prefix-cached points), and
written in the shipped profile's format as ``qwen3-30b-a3b-<gpu>-measured.json``
beside the check's JSON. Only degree 1 is measured (one GPU: no CP); its provenance
says so, and how and where it was measured. The record compares the fitted
coefficients and E_1 with the shipped, derived profile's.
"""

from __future__ import annotations

import datetime as dt
import re
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from vertumnus.perfmodel import Profile, Sample, fit_profile

SHIPPED_PROFILE = "qwen3-30b-a3b-h100"
COMPARE_AT = (1024, 8192, 32768)


def gpu_slug(name: str) -> str:
    """``NVIDIA H200`` -> ``h200``, ``NVIDIA H100 PCIe`` -> ``h100-pcie``; a CPU: ``cpu``."""
    if name.startswith("cpu"):
        return "cpu"
    chip = re.search(r"\b([A-Z]{1,2}\d{2,4}[A-Z]?)\b", name)
    slug = chip.group(1).lower() if chip else re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
    for variant in ("pcie", "nvl"):
        if variant in name.lower():
            slug += f"-{variant}"
    return slug


def samples_of(speed: dict[str, Any]) -> list[Sample]:
    return [
        Sample(1, point["tokens"], point["prefix"], point["engine"]["median_s"])
        for point in speed["points"]
        if point["engine"].get("status") == "ok"
    ]


def run(
    speed: dict[str, Any], out_dir: Path, hardware: str, dry_run: bool, command: str
) -> dict[str, Any]:
    """Step 3's record; writes the profile."""
    if speed.get("status") != "ok":
        raise RuntimeError(f"the speed step did not run: {speed.get('error', 'no timings')}")
    samples = samples_of(speed)
    model = speed["model"]
    full = speed["profile_comparable"]
    name = "Qwen3-30B-A3B" if full else f"{model['name']} ({model['layers']} layers)"
    provenance = {
        "method": (
            "measured, degree 1 only: the engine's C = 1 prefill (prefill_rank on one "
            f"device) of {model['layers']} layers with random {model['dtype']} weights, "
            "median of the timed runs per point, fitted by perfmodel.fit_profile; degrees "
            "> 1 need several GPUs (NCCL CP) and are not measured here"
        ),
        "measured_by": "tools/device_check.sh",
        "command": command,
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "device": hardware,
        "torch": torch.__version__,
        "dry_run": dry_run,
        "model_layers": model["layers"],
        "samples": [asdict(s) for s in samples],
        "derived_profile": SHIPPED_PROFILE,
    }
    if not full:
        provenance["note"] = "not Qwen3-30B-A3B's full shape: see model_layers"
    profile = fit_profile(samples, name, hardware, speed["block_size"], provenance)
    path = out_dir / f"qwen3-30b-a3b-{gpu_slug(hardware)}-measured.json"
    profile.save(path)
    loaded = Profile.load(path)  # what a user of the file gets
    shipped = Profile.load(SHIPPED_PROFILE)
    return {
        "path": str(path),
        "samples": len(samples),
        "coefficients": loaded.coeffs[1].to_json(),
        "mape": loaded.mape[1],
        "shipped_coefficients": shipped.coeffs[1].to_json(),
        "e1_s": {
            str(n): {"measured_fit": loaded.predict(1, n, 0), "shipped": shipped.predict(1, n, 0)}
            for n in COMPARE_AT
        },
    }
