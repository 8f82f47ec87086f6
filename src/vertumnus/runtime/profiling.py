"""The profiling protocol: measure the real engine and fit E_C(R, P) per degree.

A queue-free grid over input length and prefix-hit ratio, for every degree asked
for: one CP worker of C ranks at a time (its own ``ChildRanks``), one request at a time
through ``PrefillClient``. For each grid point and repeat, fresh random tokens:
their prefix (hit ratio x length, whole blocks) is prefilled first, untimed, so that
the timed prefill of the whole sequence reuses it. Warm-up runs come first; then the
repeats of all points run interleaved in a seeded random order (a slow spell of the
machine spreads over many points, where the median drops it), and the median of a
point's repeats is its sample. The fit uses a checkerboard half of the grid (every
length and every hit ratio in both halves); the profile records the MAPE on the
held-out half and on all points. Once the ranks are closed, the host link of rank 0's
device is measured (``runtime/host_link.py``, which also names the hardware: this
module imports it, never the other way) into the profile's ``host_link``. The
model's attention mix (its sliding-window layers, ``config.model.attention_mix``) is
what alpha is fitted against, and the profile stores it.

Owns the measurement and the fit's bookkeeping; ``cli/profile.py`` only parses
arguments and prints. The model itself is ``perfmodel.py``.
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vertumnus.config import EngineConfig, ModelConfig
from vertumnus.config.model import attention_mix
from vertumnus.perfmodel import FULL, AttentionMix, Profile, Sample, fit_profile, mape


@dataclass(frozen=True)
class ProfileGrid:
    """What to measure: degrees x lengths x hit ratios, ``repeats`` timed runs each."""

    degrees: Sequence[int]
    lengths: Sequence[int] = (128, 256, 512, 1024, 2048, 4096, 8192)
    hit_ratios: Sequence[float] = (0.0, 0.25, 0.5, 0.75)
    repeats: int = 5
    warmup: int = 2  # untimed runs per degree first
    seed: int = 0

    @property
    def points(self) -> list[tuple[int, float]]:
        return [(n, h) for n in self.lengths for h in self.hit_ratios]


@dataclass
class Measured:
    samples: list[Sample]  # one per (degree, point), in grid order, degree by degree
    hardware: str
    extra: dict[str, Any] = field(default_factory=dict)
    host_link: dict[str, Any] = field(default_factory=dict)  # ``measure_host_link``'s
    attention: AttentionMix = FULL  # the measured model's layers (``attention_mix``)


def measure(
    model: ModelConfig,
    model_dir: str | None,
    engine: EngineConfig,
    grid: ProfileGrid,
    progress: Callable[[int, int, str], None] | None = None,
) -> Measured:
    """Run the grid on the engine (``engine.kv_blocks_per_rank`` is sized here), then
    measure the host link of the ranks' device."""
    from dataclasses import replace

    from vertumnus.runtime.host_link import hardware_name, measure_host_link
    from vertumnus.runtime.prefill import PrefillClient
    from vertumnus.runtime.ranks import ChildRanks

    points = grid.points
    blocks_needed = 2 * max(grid.lengths) // engine.block_size + 2
    engine = replace(engine, kv_blocks_per_rank=blocks_needed)
    rng = random.Random(grid.seed)
    samples: list[Sample] = []
    total, done = len(grid.degrees) * len(points) * grid.repeats, 0
    hardware: str | None = None
    device, layers, attention = "cpu", "eager", "flash"
    for degree in grid.degrees:
        with ChildRanks(model, model_dir, engine, world_size=degree, degrees=[degree]) as ranks:
            if hardware is None:
                first = ranks.ready[0]
                device, layers, attention = first.device, first.layers, first.attention
                hardware = hardware_name(device)

            def one(length: int, hit: float) -> tuple[int, int, float]:
                # A fresh worker index per run: nothing but the prefix is ever reused.
                worker = PrefillClient(ranks, tuple(range(degree)))  # noqa: B023
                tokens = [rng.randrange(model.vocab_size) for _ in range(length)]
                prefix = int(length * hit) // engine.block_size * engine.block_size
                if prefix:
                    worker.prefill(tokens[:prefix])
                out = worker.prefill(tokens)
                return out.computed_tokens, out.cached_tokens, out.prefill_s

            for i in range(grid.warmup):
                one(max(grid.lengths), grid.hit_ratios[i % len(grid.hit_ratios)])
            order = [point for point in range(len(points)) for _ in range(grid.repeats)]
            rng.shuffle(order)
            runs: dict[int, list[tuple[int, int, float]]] = {i: [] for i in range(len(points))}
            for point in order:
                length, hit = points[point]
                runs[point].append(one(length, hit))
                done += 1
                if progress is not None:
                    progress(done, total, f"C={degree} L={length} hit={hit:g}")
            for point in range(len(points)):
                r, p, _ = runs[point][0]
                seconds = statistics.median(t for _, _, t in runs[point])
                samples.append(Sample(degree, r, p, seconds))
    # After the grid, with no rank running: the copies have the machine to themselves.
    host_link = measure_host_link(model, engine, device)
    extra = {"layers": layers, "attention": attention}
    return Measured(samples, hardware or "unknown", extra, host_link, attention_mix(model))


def fit_measured(
    measured: Measured,
    grid: ProfileGrid,
    model: str,
    block_size: int,
    provenance: Mapping[str, Any],
    hardware: str | None = None,
) -> tuple[Profile, list[Sample], list[Sample]]:
    """Fit on the checkerboard half; record the MAPE held out and on all points.
    Returns (profile, fitted samples, held-out samples)."""
    samples = measured.samples
    fit_set, held_out = checkerboard_split(samples, len(grid.lengths), len(grid.hit_ratios))
    profile = fit_profile(
        fit_set,
        model=model,
        hardware=hardware or measured.hardware,
        block_size=block_size,
        provenance={
            **provenance,
            "grid": {
                "lengths": list(grid.lengths),
                "hit_ratios": list(grid.hit_ratios),
                "repeats": grid.repeats,
            },
            "fit_on": "checkerboard half of the grid; mape_held_out on the other half",
        },
        attention=measured.attention,
    )
    profile.provenance["mape_held_out"] = {
        str(c): mape(profile.coeffs[c], [s for s in held_out if s.cp_degree == c])
        for c in profile.degrees
    }
    profile.provenance["mape_all"] = {
        str(c): mape(profile.coeffs[c], [s for s in samples if s.cp_degree == c])
        for c in profile.degrees
    }
    profile.host_link = dict(measured.host_link)
    return profile, fit_set, held_out


def checkerboard_split(
    samples: list[Sample], n_lengths: int, n_hits: int
) -> tuple[list[Sample], list[Sample]]:
    """(fitted, held out): samples are in grid order, degree by degree, length-major.
    A checkerboard over (length, hit ratio) puts every length and every hit ratio in
    both halves, so the held-out half tests interpolation, not a hit ratio (or a
    length) that the fit never saw."""
    per_degree = n_lengths * n_hits
    fitted: list[Sample] = []
    held_out: list[Sample] = []
    for i, sample in enumerate(samples):
        length_i, hit_i = divmod(i % per_degree, n_hits)
        (held_out if (length_i + hit_i) % 2 else fitted).append(sample)
    return fitted, held_out


def write_samples(samples: Sequence[Sample], path: Path) -> None:
    """The samples in the CSV format ``python -m vertumnus fit`` reads."""
    rows = [f"{s.cp_degree},{s.uncached_tokens},{s.cached_tokens},{s.seconds!r}" for s in samples]
    path.write_text("degree,uncached_tokens,cached_tokens,seconds\n" + "\n".join(rows) + "\n")


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
