"""Does the what-if replay rank the compositions as the fixed pools do?

    .venv/bin/python tools/replay_accuracy.py [--out results/robustness-tune]
        [--seeds 0,10] [--window-s 60]

For each robustness scenario (``tools/robustness.py``; its cached fixed runs under
``OUT/cache`` give each composition's measured mean TTFT), it runs the adaptive
pool once from the best fixed composition to record every request as the
controller samples it, then replays the whole trace, in windows of ``--window-s``
from empty queues, on every composition of the lattice, with the shipped
controller's replay model in three variants:

    cache     the replay's cache model as shipped (links, pulls, capacity)
    nolimit   the same without a capacity (every prefix left stays)
    warm      no links: every matched prefix reusable on every worker

The recorded holders are dropped (they name the recording run's workers), so a
prefix linked to no replayed request is reusable everywhere (as in the warm-up).
Prints, per scenario, each composition's measured and replayed mean TTFT, the
composition each variant would pick and how far that is from the best, and the
token hit rates of the fixed runs. A model check, not a benchmark: no timing.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent))

import robustness as rb
from vertumnus.config.pool import parse_composition
from vertumnus.policy import whatif
from vertumnus.policy.costs import reuse_curves
from vertumnus.policy.forecast import ArrivalSample
from vertumnus.policy.replay import ReplayModel, ReplayWorker
from vertumnus.sim import config as sim_config
from vertumnus.sim import scenarios
from vertumnus.sim.simulator import Simulation


def recorded(scenario: scenarios.Scenario, composition: str) -> tuple[list[ArrivalSample], object]:
    """Every request as the controller sampled it, from one adaptive run."""
    got: list[ArrivalSample] = []
    original = whatif.WhatIfController.placed

    def placed(self, request, placement, at_s, block):  # type: ignore[no-untyped-def]
        original(self, request, placement, at_s, block)
        got.append(self.forecast.by_id[request.request_id])

    cfg = sim_config.load(
        None,
        {"pool": {"composition": composition}, "sim": {"seed": scenario.seed}},
        raw={"workload": rb.TINY_WORKLOAD},
        preset="vertumnus",
    )
    whatif.WhatIfController.placed = placed  # type: ignore[method-assign]
    try:
        Simulation(
            cfg.settings, cfg.profile, cfg.spec, cfg.policy, scenarios.requests(scenario)
        ).run()
    finally:
        whatif.WhatIfController.placed = original  # type: ignore[method-assign]
    return [replace(s, holders=(), floor_tokens=0) for s in got], cfg


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
        result = model.run(
            model.prepare(samples[j:k], samples[j].arrival_s, 1.0, window_s, warm=True), pool
        )
        total += result.mean_ttft_s * result.requests
        n += result.requests
        j = k
    return total / n if n else 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="results/robustness-tune")
    parser.add_argument("--seeds", default="0,10")
    parser.add_argument("--window-s", type=float, default=60.0)
    args = parser.parse_args()
    out = Path(args.out)
    for seed in (int(x) for x in args.seeds.split(",")):
        scenario = rb.piloted(out, seed)
        fixed: dict[str, dict[str, float]] = {}
        for label, preset, comp in rb.run_labels(scenario):
            path = rb.cache_path(out, rb.cache_key(scenario, label))
            if preset == "fixed" and path.exists():
                fixed[comp] = orjson.loads(path.read_bytes())["row"]
        if not fixed:
            print(f"seed {seed}: no cached fixed runs under {out} (run tools/robustness.py first)")
            continue
        best = min(fixed, key=lambda c: fixed[c]["mean_ttft_s"])
        samples, cfg = recorded(scenario, best)
        pool = cfg.spec  # type: ignore[attr-defined]
        policy = cfg.policy  # type: ignore[attr-defined]
        coeffs = {c: cfg.profile.coeffs[c] for c in pool.lattice.degrees}  # type: ignore[attr-defined]
        per_rank = pool.blocks_per_rank * pool.block_tokens
        pull = (policy.cache.copy_latency_s, policy.cache.copy_block_s / pool.block_tokens)
        variants = {
            "cache": (samples, per_rank),
            "nolimit": (samples, None),
            "warm": ([replace(s, link_key=0) for s in samples], None),
        }
        rows: dict[str, dict[str, float]] = {}
        for name, (use, capacity) in variants.items():
            model = ReplayModel(
                reuse_curves(coeffs), pool.lattice.degrees, policy.weights, None, 0.0,
                policy.max_tokens_per_rank, capacity, pull,
            )  # fmt: skip
            for comp in fixed:
                rows.setdefault(comp, {})[name] = replayed(model, use, comp, args.window_s)
        linked = sum(1 for s in samples if s.link_key)
        print(f"seed {seed}: {len(samples)} requests, {linked} with a match; best fixed {best}")
        for comp in sorted(fixed, key=lambda c: fixed[c]["mean_ttft_s"]):
            row = fixed[comp]
            cells = "  ".join(f"{k} {v:.3f}" for k, v in rows[comp].items())
            measured = f"measured {row['mean_ttft_s']:.3f} (hit {row['token_hit_rate']:.3f})"
            print(f"  {comp:10s} {measured}  {cells}")
        for name in variants:
            pick = min(rows, key=lambda c: rows[c][name])
            ratio = fixed[pick]["mean_ttft_s"] / fixed[best]["mean_ttft_s"]
            print(f"  {name} picks {pick}: {ratio:.3f}x the best fixed")


if __name__ == "__main__":
    main()
