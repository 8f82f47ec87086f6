"""``python -m vertumnus fit``: fit E_C(R, P) per degree from measured samples.

``--samples F.csv`` has the header ``degree,uncached_tokens,cached_tokens,seconds``;
malformed rows are rejected with their line number. Writes a profile JSON and prints
the per-degree fit error (MAPE) on the samples. When ``--model`` is a preset or a model
folder, alpha is fitted against its attention mix (sliding-window layers,
``config.model.attention_mix``) and the profile stores the mix; any other name: every
layer full causal attention.
"""

from __future__ import annotations

import argparse
import datetime as dt
import platform
import sys
from pathlib import Path

from vertumnus.config import PRESETS, ConfigError, EngineConfig, resolve_model
from vertumnus.config.model import attention_mix
from vertumnus.perfmodel import FULL, AttentionMix, ProfileError, fit_profile, read_samples_csv


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--samples",
        type=Path,
        required=True,
        metavar="F.csv",
        help="measured samples: degree,uncached_tokens,cached_tokens,seconds",
    )
    p.add_argument(
        "--out", type=Path, required=True, metavar="PROFILE.json", help="where to write the profile"
    )
    p.add_argument(
        "--model",
        default="unknown",
        help="model name recorded in the profile (a preset or model folder: also its "
        "attention mix)",
    )
    p.add_argument(
        "--hardware",
        default=platform.machine() or "unknown",
        help="hardware name recorded in the profile (default: this machine)",
    )
    p.add_argument(
        "--block-size",
        type=int,
        default=EngineConfig().block_size,
        help="KV block size the samples were measured with",
    )


def model_attention(spec: str) -> AttentionMix:
    """The attention mix of ``spec`` if it names a preset or a model folder (whose
    ``config.json`` must then be readable), else full."""
    if spec not in PRESETS and not Path(spec).is_dir():
        return FULL
    return attention_mix(resolve_model(spec)[0])


def run(args: argparse.Namespace) -> int:
    try:
        samples = read_samples_csv(args.samples)
        profile = fit_profile(
            samples,
            model=args.model,
            hardware=args.hardware,
            block_size=args.block_size,
            provenance={
                "command": " ".join(["python -m vertumnus", *sys.argv[1:]]),
                "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
                "machine": platform.node(),
                "samples": str(args.samples),
            },
            attention=model_attention(args.model),
        )
        if not args.out.parent.is_dir():
            raise ConfigError(f"--out {args.out}: no directory {args.out.parent}")
        profile.save(args.out)
    except ProfileError as exc:
        raise ConfigError(str(exc)) from exc
    for degree in profile.degrees:
        n = sum(1 for s in samples if s.cp_degree == degree)
        print(f"degree {degree}: {n} samples, MAPE {100 * profile.mape[degree]:.2f}%")
    if not profile.attention.full:
        print(f"attention (share of layers, window): {list(profile.attention.groups)}")
    print(f"profile written to {args.out}")
    return 0
