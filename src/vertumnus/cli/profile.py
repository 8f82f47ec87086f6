"""``python -m vertumnus profile``: measure the real engine, fit E_C(R, P) per degree.

The protocol (a queue-free grid over input length and prefix-hit ratio, interleaved
shuffled repeats, medians, a checkerboard held-out half) is
``vertumnus.runtime.profiling``'s; this module parses the arguments and prints. CPU
ranks get one intra-op thread each by default (one rank = one core, as one rank =
one GPU on a GPU pool). The profile also gets the measured host link
(``runtime/host_link.py``): KV bytes per token and the bandwidths each way between
a rank's KV store and the host tier's memory.
"""

from __future__ import annotations

import argparse
import datetime as dt
import platform
import sys
from pathlib import Path

from vertumnus.cli.args import int_list, ratio_list
from vertumnus.config import ConfigError, EngineConfig, resolve_model
from vertumnus.runtime.profiling import ProfileGrid
from vertumnus.stats import progress


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="tiny", help="preset or Hugging Face folder")
    p.add_argument("--degrees", type=int_list, default=[1, 2], help="e.g. 1,2,4 (default 1,2)")
    p.add_argument("--out", type=Path, required=True, metavar="PROFILE.json")
    p.add_argument(
        "--lengths",
        type=int_list,
        default=list(ProfileGrid.lengths),
        help="input lengths of the grid",
    )
    p.add_argument(
        "--hit-ratios",
        type=ratio_list,
        default=None,
        help="prefix-hit ratios of the grid (default: "
        f"{', '.join(map(str, ProfileGrid.hit_ratios))}; 0 alone for a model whose "
        "prefixes the pool does not cache: DeepSeek-V4)",
    )
    p.add_argument(
        "--repeats", type=int, default=ProfileGrid.repeats, help="timed runs per point (median)"
    )
    p.add_argument(
        "--warmup", type=int, default=ProfileGrid.warmup, help="untimed runs per degree first"
    )
    p.add_argument("--block-size", type=int, default=EngineConfig().block_size)
    p.add_argument("--threads-per-rank", type=int, default=1)
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument(
        "--dtype",
        default=EngineConfig().dtype,
        choices=("auto", "float32", "bfloat16", "float16"),
        help="the ranks' dtype (auto: what serve runs, recorded in the profile)",
    )
    p.add_argument(
        "--compile",
        default=EngineConfig().compile,
        choices=("auto", "on", "off"),
        help="compile the ranks' layers (auto: as serve does; recorded in the profile)",
    )
    p.add_argument(
        "--cpu-attention",
        default=EngineConfig().cpu_attention,
        choices=("auto", "flash", "chunked"),
        help="a CPU rank's attention kernel (auto: as serve does; recorded in the profile)",
    )
    p.add_argument(
        "--hardware",
        default=None,
        help="recorded in the profile (default: cpu-<machine> or the CUDA device name)",
    )
    p.add_argument(
        "--samples-out",
        type=Path,
        default=None,
        metavar="F.csv",
        help="also write the measured samples (the format `fit` reads)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--plot",
        type=Path,
        default=None,
        metavar="FIT.png",
        help="predicted against measured time per degree (held-out points marked)",
    )


def measured_dtype(engine: EngineConfig) -> str:
    """The dtype the ranks computed in: what ``auto`` resolved to on this host."""
    from vertumnus.runtime.kv.segments import kv_dtype

    return str(kv_dtype(engine)).removeprefix("torch.")


def run(args: argparse.Namespace) -> int:
    cfg, model_dir = resolve_model(args.model)
    if args.repeats < 1 or args.warmup < 0:
        raise ConfigError("--repeats must be >= 1 and --warmup >= 0")
    too_long = [n for n in args.lengths if n > cfg.max_position_embeddings]
    if too_long:
        raise ConfigError(f"lengths {too_long} exceed the model's max_position_embeddings")
    for flag, path in (
        ("--out", args.out),
        ("--plot", args.plot),
        ("--samples-out", args.samples_out),
    ):
        if path is not None and not path.parent.is_dir():
            raise ConfigError(f"{flag} {path}: no directory {path.parent}")
    hit_ratios = args.hit_ratios
    uncached = cfg.block_cache_problem(args.block_size)
    if hit_ratios is None:
        hit_ratios = list(ProfileGrid.hit_ratios) if uncached is None else [0.0]
    elif uncached is not None and any(hit_ratios):
        raise ConfigError(f"--hit-ratios: give 0 alone; {uncached}")
    grid = ProfileGrid(
        degrees=args.degrees,
        lengths=args.lengths,
        hit_ratios=hit_ratios,
        repeats=args.repeats,
        warmup=args.warmup,
        seed=args.seed,
    )
    if len(grid.points) < 8:
        raise ConfigError(
            f"the grid has {len(grid.points)} points; the fit (on half of them) needs "
            "at least 8: give more --lengths or --hit-ratios"
        )
    from vertumnus.runtime import profiling

    engine = EngineConfig(
        block_size=args.block_size,
        device=args.device,
        threads_per_rank=args.threads_per_rank,
        seed=args.seed,
        dtype=args.dtype,
        compile=args.compile,
        cpu_attention=args.cpu_attention,
    )
    measured = profiling.measure(cfg, model_dir, engine, grid, progress)
    profile, fit_set, held_out = profiling.fit_measured(
        measured,
        grid,
        model=cfg.name,
        block_size=args.block_size,
        hardware=args.hardware,
        provenance={
            "command": " ".join(["python -m vertumnus", *sys.argv[1:]]),
            "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
            "machine": platform.node(),
            "threads_per_rank": args.threads_per_rank,
            "dtype": measured_dtype(engine),
            "layers": measured.extra["layers"],
            "attention": measured.extra["attention"],
        },
    )
    profile.save(args.out)
    if args.samples_out is not None:
        profiling.write_samples(measured.samples, args.samples_out)
    if args.plot is not None:
        profiling.plot_fit(profile, fit_set, held_out, args.plot)
    for c in profile.degrees:
        print(
            f"degree {c}: MAPE fit {100 * profile.mape[c]:.2f}%, held-out "
            f"{100 * profile.provenance['mape_held_out'][str(c)]:.2f}%"
        )
    if not profile.attention.full:
        print(f"attention (share of layers, window): {list(profile.attention.groups)}")
    link = profile.host_link
    if link:
        print(
            f"host link: device-to-host {link['d2h_bytes_s'] / 1e9:.2f} GB/s, host-to-device "
            f"{link['h2d_bytes_s'] / 1e9:.2f} GB/s, {link['kv_bytes_per_token']} KV bytes/token"
        )
    print(f"profile written to {args.out}")
    return 0
