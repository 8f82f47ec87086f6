"""Does the what-if replay rank the compositions as the fixed pools do?

    .venv/bin/python -m tools.experiments.replay_accuracy [--out results/robustness-tune]
        [--seeds 0,10] [--window-s 60] [--ideal]

For each robustness scenario (``tools/experiments/robustness.py``; its cached fixed
runs under ``OUT/cache`` give each composition's measured mean TTFT and token hit
rate), it runs the adaptive pool once from the best fixed composition to record every
request as the controller samples it, then replays the whole trace, in windows of
``--window-s`` from empty queues, on every composition of the lattice with the
controller's replay model (the profile's times, uncalibrated), each request's
prefix reusable wherever the trie had matched it (the warm-up's replay: reuse
that does not depend on the composition). ``--ideal`` also runs the fixed pools
with ideal replication (every prefix reusable on every worker), the simulator's
counterpart of that assumption.

Prints, per scenario and composition, the measured and the replayed mean TTFT,
the composition the replay would pick and how far that is from the best fixed.
A model check, not a benchmark: no timing.
"""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path
from typing import Any

from tools.experiments import robustness as rb
from vertumnus.config.pool import parse_composition
from vertumnus.policy.control import whatif
from vertumnus.policy.control.forecast import ArrivalSample
from vertumnus.policy.control.replay import ReplayModel
from vertumnus.policy.control.replay_types import ReplayWorker
from vertumnus.policy.costs import reuse_curves
from vertumnus.sim import scenarios
from vertumnus.sim.simulator import Simulation


def recorded(scenario: scenarios.Scenario, composition: str) -> tuple[list[ArrivalSample], Any]:
    """Every request as the controller sampled it, from one adaptive run (as revised
    at its start: the reuse it found there, a predecessor's prefix among it)."""
    got: dict[int, ArrivalSample] = {}
    cls = whatif.WhatIfController
    original_placed, original_started = cls.placed, cls.started

    def placed(self, request, placement, at_s, block):  # type: ignore[no-untyped-def]
        original_placed(self, request, placement, at_s, block)
        got[request.request_id] = self.forecast.by_id[request.request_id]

    def started(self, request_id, worker_id, reused_tokens, key):  # type: ignore[no-untyped-def]
        original_started(self, request_id, worker_id, reused_tokens, key)
        if request_id in got and request_id in self.forecast.by_id:
            got[request_id] = self.forecast.by_id[request_id]

    cfg, reqs = rb.configured(scenario, "vertumnus", composition)
    cls.placed, cls.started = placed, started  # type: ignore[method-assign]
    try:
        Simulation(cfg.settings, cfg.profile, cfg.spec, cfg.policy, reqs).run()
    finally:
        cls.placed, cls.started = original_placed, original_started  # type: ignore[method-assign]
    return [replace(s, holders=(), floor_tokens=0) for s in got.values()], cfg


def replayed(
    model: ReplayModel, samples: list[ArrivalSample], composition: str, window_s: float
) -> float:
    counts = parse_composition(composition)
    degrees = [degree for degree in sorted(counts) for _ in range(counts[degree])]
    pool = [ReplayWorker(k, degree, 0.0) for k, degree in enumerate(degrees)]
    total = 0.0
    n = j = 0
    while j < len(samples):
        k = j
        while k < len(samples) and samples[k].arrival_s < samples[j].arrival_s + window_s:
            k += 1
        window = model.prepare(samples[j:k], samples[j].arrival_s, 1.0, window_s, warm=True)
        result = model.run(window, pool)
        total += result.mean_ttft_s * result.requests
        n += result.requests
        j = k
    return total / n if n else 0.0


def ideal(scenario: scenarios.Scenario, composition: str) -> float:
    cfg, reqs = rb.configured(scenario, "ideal-replication", composition)
    result = Simulation(cfg.settings, cfg.profile, cfg.spec, cfg.policy, reqs).run()
    ttfts = [t for r in result.records if (t := r.ttft_s) is not None]
    return sum(ttfts) / len(ttfts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="results/robustness-tune")
    parser.add_argument("--seeds", default="0,10")
    parser.add_argument("--window-s", type=float, default=60.0)
    parser.add_argument("--ideal", action="store_true")
    args = parser.parse_args()
    out = Path(args.out)
    for seed in (int(x) for x in args.seeds.split(",")):
        scenario = rb.piloted(out, seed)
        fixed: dict[str, dict[str, Any]] = {}
        for label, preset, comp in rb.run_labels(scenario):
            path = rb.cache_path(out, rb.cache_key(scenario, label))
            if preset == "fixed" and path.exists():
                fixed[comp] = rb.cached_row(path)
        if not fixed:
            print(
                f"seed {seed}: no cached fixed runs under {out} "
                "(run tools/experiments/robustness.py)"
            )
            continue
        best = min(fixed, key=lambda c: fixed[c]["mean_ttft_s"])
        samples, cfg = recorded(scenario, best)
        pool, policy = cfg.spec, cfg.policy
        coeffs = {c: cfg.profile.coeffs[c] for c in pool.lattice.degrees}
        model = ReplayModel(
            reuse_curves(coeffs), pool.lattice.degrees, policy.weights, None,
            policy.max_tokens_per_rank,
        )  # fmt: skip
        predicted = {comp: replayed(model, samples, comp, args.window_s) for comp in fixed}
        print(f"seed {seed}: {len(samples)} requests; best fixed {best}")
        for comp in sorted(fixed, key=lambda c: fixed[c]["mean_ttft_s"]):
            row = fixed[comp]
            line = (
                f"  {comp:10s} measured {row['mean_ttft_s']:.3f} s (hit "
                f"{row['token_hit_rate']:.3f}), replayed {predicted[comp]:.3f} s"
            )
            if args.ideal:
                line += f", ideal replication measured {ideal(scenario, comp):.3f} s"
            print(line)
        pick = min(predicted, key=lambda c: predicted[c])
        ratio = fixed[pick]["mean_ttft_s"] / fixed[best]["mean_ttft_s"]
        print(f"  the replay picks {pick}: {ratio:.3f}x the best fixed")


if __name__ == "__main__":
    main()
