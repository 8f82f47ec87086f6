"""``python -m vertumnus profile``: measure the real engine, fit E_C(R, P) per degree.

A queue-free grid over input length and prefix-hit ratio, for every degree asked
for: one CP worker of C ranks at a time (its own rank pool), one request at a time.
For each grid point and repeat, fresh random tokens: their prefix (hit ratio x
length, whole blocks) is prefilled first, untimed, so that the timed prefill of the
whole sequence reuses it. Warm-up runs come first; then the repeats of all points
run interleaved in a seeded random order, and the median of a point's repeats is its
sample. The fit uses a checkerboard half of the grid (every length and every hit
ratio in both halves); the profile records the MAPE on the held-out half and on all
points. CPU ranks get one intra-op thread each by default (one rank = one core, as
one rank = one GPU on a GPU pool).
"""

from __future__ import annotations

import argparse
import datetime as dt
import platform
import random
import statistics
import sys
from pathlib import Path

from vertumnus.cli_args import int_list, ratio_list
from vertumnus.config import ConfigError, EngineConfig, resolve_model
from vertumnus.perfmodel import Profile, Sample, fit_profile, mape
from vertumnus.stats import progress


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="tiny", help="preset or Hugging Face folder")
    p.add_argument("--degrees", type=int_list, default=[1, 2], help="e.g. 1,2,4 (default 1,2)")
    p.add_argument("--out", type=Path, required=True, metavar="PROFILE.json")
    p.add_argument(
        "--lengths",
        type=int_list,
        default=[128, 256, 512, 1024, 2048, 4096, 8192],
        help="input lengths of the grid",
    )
    p.add_argument(
        "--hit-ratios",
        type=ratio_list,
        default=[0.0, 0.25, 0.5, 0.75],
        help="prefix-hit ratios of the grid",
    )
    p.add_argument("--repeats", type=int, default=5, help="timed runs per point (median)")
    p.add_argument("--warmup", type=int, default=2, help="untimed runs per degree first")
    p.add_argument("--block-size", type=int, default=EngineConfig().block_size)
    p.add_argument("--threads-per-rank", type=int, default=1)
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
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
    from vertumnus.runtime.pool import RankPool
    from vertumnus.runtime.worker import PrefillWorker

    grid = [(n, h) for n in args.lengths for h in args.hit_ratios]
    if len(grid) < 8:
        raise ConfigError(
            f"the grid has {len(grid)} points; the fit (on half of them) needs "
            "at least 8: give more --lengths or --hit-ratios"
        )
    blocks_needed = 2 * max(args.lengths) // args.block_size + 2
    rng = random.Random(args.seed)
    samples: list[Sample] = []
    total, done = len(args.degrees) * len(grid) * args.repeats, 0
    hardware = args.hardware
    for degree in args.degrees:
        engine = EngineConfig(
            block_size=args.block_size,
            device=args.device,
            threads_per_rank=args.threads_per_rank,
            seed=args.seed,
            kv_blocks_per_rank=blocks_needed,
        )
        with RankPool(cfg, model_dir, engine, world_size=degree, degrees=[degree]) as pool:
            if hardware is None:
                hardware = _hardware(pool.ready[0].device)

            def measure(length: int, hit: float) -> tuple[int, int, float]:
                # A fresh worker index per run: nothing but the prefix is ever reused.
                worker = PrefillWorker(pool, tuple(range(degree)))  # noqa: B023
                tokens = [rng.randrange(cfg.vocab_size) for _ in range(length)]
                prefix = int(length * hit) // args.block_size * args.block_size
                if prefix:
                    worker.prefill(tokens[:prefix])
                out = worker.prefill(tokens)
                return out.computed_tokens, out.cached_tokens, out.prefill_s

            for i in range(args.warmup):
                measure(max(args.lengths), args.hit_ratios[i % len(args.hit_ratios)])
            # Repeats interleaved in a shuffled order, so that a slow spell of the
            # machine spreads over many points (where the median drops it) instead of
            # shifting every repeat of a few neighbouring points.
            order = [point for point in range(len(grid)) for _ in range(args.repeats)]
            rng.shuffle(order)
            runs: dict[int, list[tuple[int, int, float]]] = {i: [] for i in range(len(grid))}
            for point in order:
                length, hit = grid[point]
                runs[point].append(measure(length, hit))
                done += 1
                progress(done, total, f"C={degree} L={length} hit={hit:g}")
            for point in range(len(grid)):
                r, p, _ = runs[point][0]
                seconds = statistics.median(t for _, _, t in runs[point])
                samples.append(Sample(degree, r, p, seconds))
    fit_set, held_out = checkerboard_split(samples, len(args.lengths), len(args.hit_ratios))
    profile = fit_profile(
        fit_set,
        model=cfg.name,
        hardware=hardware or "unknown",
        block_size=args.block_size,
        provenance={
            "command": " ".join(["python -m vertumnus", *sys.argv[1:]]),
            "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
            "machine": platform.node(),
            "threads_per_rank": args.threads_per_rank,
            "grid": {
                "lengths": args.lengths,
                "hit_ratios": args.hit_ratios,
                "repeats": args.repeats,
            },
            "fit_on": "checkerboard half of the grid; mape_held_out on the other half",
        },
    )
    profile.provenance["mape_held_out"] = {
        str(c): mape(profile.coeffs[c], [s for s in held_out if s.cp_degree == c])
        for c in profile.degrees
    }
    profile.provenance["mape_all"] = {
        str(c): mape(profile.coeffs[c], [s for s in samples if s.cp_degree == c])
        for c in profile.degrees
    }
    profile.save(args.out)
    if args.samples_out is not None:
        rows = [
            f"{s.cp_degree},{s.uncached_tokens},{s.cached_tokens},{s.seconds!r}" for s in samples
        ]
        args.samples_out.write_text(
            "degree,uncached_tokens,cached_tokens,seconds\n" + "\n".join(rows) + "\n"
        )
    if args.plot is not None:
        plot_fit(profile, fit_set, held_out, args.plot)
    for c in profile.degrees:
        print(
            f"degree {c}: MAPE fit {100 * profile.mape[c]:.2f}%, held-out "
            f"{100 * profile.provenance['mape_held_out'][str(c)]:.2f}%"
        )
    print(f"profile written to {args.out}")
    return 0


def checkerboard_split(
    samples: list[Sample], n_lengths: int, n_hits: int
) -> tuple[list[Sample], list[Sample]]:
    """(fitted, held out): samples are in grid order, degree by degree, length-major.
    A checkerboard over (length, hit ratio) puts every length and every hit ratio in
    both halves, so the held-out half tests interpolation, not a hit ratio (or a
    length) that the fit never saw."""
    per_degree = n_lengths * n_hits
    fitted, held_out = [], []
    for i, sample in enumerate(samples):
        length_i, hit_i = divmod(i % per_degree, n_hits)
        (held_out if (length_i + hit_i) % 2 else fitted).append(sample)
    return fitted, held_out


def _hardware(device: str) -> str:
    if device.startswith("cuda"):
        import torch

        return torch.cuda.get_device_name(torch.device(device))
    return f"cpu-{platform.machine()}-{platform.processor() or 'unknown'}"


def plot_fit(profile: Profile, fitted: list[Sample], held_out: list[Sample], path: Path) -> None:
    """One panel per degree: predicted against measured seconds, log-log, y = x drawn
    (as the paper's Figure 4), fitted points filled and held-out points hollow."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    degrees = profile.degrees
    fig, axes = plt.subplots(1, len(degrees), figsize=(4 * len(degrees), 4), squeeze=False)
    for ax, c in zip(axes[0], degrees, strict=True):
        for points, style in (
            (fitted, {"label": "fitted"}),
            (held_out, {"label": "held out", "facecolors": "none", "edgecolors": "C1"}),
        ):
            mine = [s for s in points if s.cp_degree == c]
            measured = [s.seconds for s in mine]
            predicted = [profile.predict(c, s.uncached_tokens, s.cached_tokens) for s in mine]
            ax.scatter(measured, predicted, s=18, **style)
        everything = [s.seconds for s in (*fitted, *held_out) if s.cp_degree == c]
        lo, hi = min(everything) * 0.8, max(everything) * 1.25
        ax.plot([lo, hi], [lo, hi], color="grey", linewidth=1)
        ax.set(
            xscale="log",
            yscale="log",
            xlim=(lo, hi),
            ylim=(lo, hi),
            xlabel="measured prefill time (s)",
            ylabel="predicted E_C(R, P) (s)",
            title=f"C = {c}: MAPE held out "
            f"{100 * profile.provenance['mape_held_out'][str(c)]:.1f} %",
        )
        ax.legend(loc="upper left")
    fig.suptitle(f"{profile.model} on {profile.hardware}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
