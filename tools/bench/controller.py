"""How long one what-if decision takes: forecast, candidates and replays, at 40 and
1,024 GPUs (the controller: ``docs/scheduling.md``, "The what-if controller";
targets: under 20 ms median at 40 GPUs, under 50 ms at 1,024).

    .venv/bin/python -m tools.bench.controller [--seconds 90]

(The server computes ``evaluate`` on its decision thread, off the event loop.)

Each size runs the simulator on a slice of its experiment (``configs/sim/
all-policies.toml`` at x8 for 40 GPUs, ``configs/sim/scale-1024.toml`` for 1,024),
and times every decision of the what-if controller there: ``prepare`` (on the
server's event loop), ``evaluate`` (the replays: on the decision thread) and
``conclude``. It prints the median and P90 of each part and of the whole, the
forecast size and the replay dilation, and the ratio of the median to its target.
Then it evaluates every decision's plan again, once with the replay loop that runs
(compiled where ``tools/build_native.py`` built it) and once with the pure Python
loop, checks that both give the same evaluation, and prints the ratio of their
medians. ``--seconds 330`` reaches the steady state of the 1,024-GPU slice (its
long window full: five minutes of arrivals); the default 90 s does not. ``--json
PATH`` writes the figures with the machine and source they were measured on
(``harness.py``).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from pathlib import Path
from typing import Any

from tools.bench import harness
from vertumnus import native
from vertumnus.config import read_toml
from vertumnus.policy.control import replay, replay_loop, search
from vertumnus.policy.control.whatif import WhatIfController
from vertumnus.sim import config as sim_config
from vertumnus.sim.simulator import Simulation
from vertumnus.stats import percentile

CASES = [
    # (name, config, composition, rate scale, target median s)
    ("40 GPUs (all-policies x8)", "configs/sim/all-policies.toml", "4CP4/3CP8", 8.0, 0.020),
    ("1,024 GPUs (scale-1024)", "configs/sim/scale-1024.toml", "128CP4/64CP8", None, 0.050),
]


class Timed:
    """Wraps a WhatIfController's three steps with timers. The collector is paused
    during each step: a full collection of a server's heap (its trie holds millions
    of nodes) takes 0.1-0.7 s whenever allocation triggers it, wherever that falls;
    those pauses are counted apart (the simulator pauses it for a whole run)."""

    def __init__(self, controller: WhatIfController) -> None:
        self.parts: dict[str, list[float]] = {"prepare": [], "evaluate": [], "conclude": []}
        self.gc_pauses: list[float] = []
        started = [0.0]

        def watch(phase: str, info: dict[str, int]) -> None:
            if info["generation"] != 2:
                return
            if phase == "start":
                started[0] = time.perf_counter()
            else:
                self.gc_pauses.append(time.perf_counter() - started[0])

        gc.callbacks.append(watch)
        self.sizes: list[tuple[int, float, int]] = []
        self.plans: list[Any] = []
        for name in self.parts:
            setattr(controller, name, self._wrap(name, getattr(controller, name)))

    def _wrap(self, name: str, fn: Any) -> Any:
        def timed(*args: Any) -> Any:
            was = gc.isenabled()  # (the simulator pauses it for its runs)
            gc.disable()
            try:
                t = time.perf_counter()
                out = fn(*args)
                self.parts[name].append(time.perf_counter() - t)
            finally:
                if was:
                    gc.enable()
            if name == "evaluate":
                self.plans.append(args[0])
            if name == "prepare":
                self.sizes.append(
                    (out.forecast_requests, out.forecast.dilation, len(out.candidates))
                )
            return out

        return timed


def run_case(path: str, composition: str, rate_scale: float | None, seconds: float) -> Timed:
    raw = read_toml(Path(path))
    raw.pop("experiment", None)
    overrides = {"pool": {"composition": composition}, "workload": {"rate_scale": rate_scale}}
    cfg = sim_config.load(None, overrides, raw=raw, preset="vertumnus")
    requests = [r for r in cfg.requests if r.arrival_s <= seconds]
    sim = Simulation(cfg.settings, cfg.profile, cfg.spec, cfg.policy, requests)
    controller = sim.policy.controller
    assert isinstance(controller, WhatIfController)
    timed = Timed(controller)
    sim.run()
    return timed


def evaluate_times(plans: list[Any]) -> tuple[list[float], list[Any]]:
    times, outs = [], []
    gc.disable()
    try:
        for plan in plans:
            t = time.perf_counter()
            outs.append(search.evaluate(plan))
            times.append(time.perf_counter() - t)
    finally:
        gc.enable()
    return times, outs


def against_pure(plans: list[Any]) -> dict[str, Any]:
    """The same plans evaluated by the loop in use and by the pure Python one."""
    used, used_out = evaluate_times(plans)
    compiled = replay.Replay
    replay.Replay = search.Replay = replay_loop.Replay  # type: ignore[misc]
    try:
        pure, pure_out = evaluate_times(plans)
    finally:
        replay.Replay = search.Replay = compiled  # type: ignore[misc]
    a, b = statistics.median(used), statistics.median(pure)
    same = used_out == pure_out
    print(
        f"  evaluate again, the same {len(plans)} plans: this loop {a * 1e3:.2f} ms, pure Python "
        f"{b * 1e3:.2f} ms (median) -> {b / a:.2f}x; "
        + ("the same evaluations" if same else "DIFFERENT EVALUATIONS")
    )
    return {
        "plans": len(plans),
        "this_loop_median_s": a,
        "pure_python_median_s": b,
        "ratio": b / a,
        "same_evaluations": same,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.partition("\n")[0])
    parser.add_argument("--seconds", type=float, default=90.0, help="simulated seconds per case")
    harness.add_arguments(parser)
    args = parser.parse_args()
    session = harness.Session("controller", args)
    print(f"replay loop: {native.status()}")
    cases: dict[str, Any] = {}
    for name, path, composition, rate_scale, target in CASES:
        timed = run_case(path, composition, rate_scale, args.seconds)
        whole = [sum(p) for p in zip(*timed.parts.values(), strict=True)]
        print(f"{name}: {len(whole)} decisions")
        for part, values in timed.parts.items():
            print(
                f"  {part:<9} median {statistics.median(values) * 1e3:7.2f} ms"
                f"  p90 {percentile(values, 90) * 1e3:7.2f} ms"
            )
        med = statistics.median(whole)
        print(
            f"  whole     median {med * 1e3:7.2f} ms  p90 {percentile(whole, 90) * 1e3:7.2f} ms"
            f"  -> {med / target:.2f}x of the {target * 1e3:.0f} ms target"
        )
        requests = [n for n, _, _ in timed.sizes]
        dilation = [d for _, d, _ in timed.sizes]
        candidates = [c for _, _, c in timed.sizes]
        if timed.gc_pauses:
            print(
                f"  (full collections of the whole process's heap, outside the decision: "
                f"{len(timed.gc_pauses)}, median {statistics.median(timed.gc_pauses) * 1e3:.0f} ms)"
            )
        print(
            f"  forecast median {statistics.median(requests):.0f} requests, dilation "
            f"median {statistics.median(dilation):.1f}, candidates median "
            f"{statistics.median(candidates):.0f}"
        )
        cases[name] = {
            "config": path,
            "composition": composition,
            "rate_scale": rate_scale,
            "decisions": len(whole),
            "parts_s": {part: harness.summary(values) for part, values in timed.parts.items()},
            "whole_s": harness.summary(whole),
            "target_median_s": target,
            "gc_pauses_s": harness.summary(timed.gc_pauses),
            "forecast_requests_median": statistics.median(requests),
            "dilation_median": statistics.median(dilation),
            "candidates_median": statistics.median(candidates),
            "against_pure": against_pure(timed.plans),
        }
    session.finish(
        args.json, {"seconds": args.seconds, "replay_loop": native.status(), "cases": cases}
    )


if __name__ == "__main__":
    main()
