"""How fast the simulator runs a pool of 1,024 GPUs: wall time over simulated time
(target: under 1, faster than real time; ``docs/simulator.md``, "At cluster scale").

    .venv/bin/python -m tools.bench.sim_speed [--seconds 363] [--collector]

Runs ``configs/sim/scale-1024.toml`` (128 hosts of 8, degrees {4, 8}, the
conversation trace at 600 / 900 / 400 req/s) as ``vertumnus`` from 128CP4/64CP8,
everything on, over its arrivals up to ``--seconds`` (default: all of them, 362.8 s
simulated). It prints the wall time of ``Simulation.run``, the simulated time, their
ratio, the requests and the collector's work. ``--collector`` keeps Python's cyclic
collector running during the run, as it did before the simulator paused it: the
same run, to measure what the pause saves (each collection's time and the objects
it found are counted; at this scale it found none). ``--json PATH`` writes the
figures with the machine and source (``harness.py``).
"""

from __future__ import annotations

import argparse
import gc
import time
from pathlib import Path
from typing import Any

from tools.bench import harness
from vertumnus.config import read_toml
from vertumnus.sim import config as sim_config
from vertumnus.sim import simulator
from vertumnus.sim.simulator import Simulation

CONFIG = "configs/sim/scale-1024.toml"
COMPOSITION = "128CP4/64CP8"


class Collections:
    """Every collection of the cyclic collector while it is installed: its time and
    the objects it freed."""

    def __init__(self) -> None:
        self.seconds: list[float] = []
        self.collected = 0
        self.counting = True
        self._started = 0.0

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if not self.counting:
            return
        if phase == "start":
            self._started = time.perf_counter()
        else:
            self.seconds.append(time.perf_counter() - self._started)
            self.collected += info["collected"]


def run(seconds: float | None, collector: bool) -> dict[str, Any]:
    raw = read_toml(Path(CONFIG))
    raw.pop("experiment", None)
    overrides = {"pool": {"composition": COMPOSITION}}
    cfg = sim_config.load(None, overrides, raw=raw, preset="vertumnus")
    requests = [r for r in cfg.requests if seconds is None or r.arrival_s <= seconds]
    sim = Simulation(cfg.settings, cfg.profile, cfg.spec, cfg.policy, requests)
    collections = Collections()
    gc.collect()
    gc.callbacks.append(collections)
    try:
        if collector:  # (``_run``: the run as it was, the collector left running)
            result = sim._run()
        else:  # (``run``, but counting stops before the collector is back)
            with simulator.collector_paused():
                result = sim._run()
                collections.counting = False
    finally:
        gc.callbacks.remove(collections)
    return {
        "requests": len(requests),
        "simulated_s": result.sim_end_s,
        "wall_s": result.wall_s,
        "wall_over_simulated": result.wall_s / result.sim_end_s,
        "collector": "running" if collector else "paused (the default)",
        "collections": len(collections.seconds),
        "collections_s": sum(collections.seconds),
        "objects_collected": collections.collected,
        "reshapes": len(result.reshapes),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.partition("\n")[0])
    parser.add_argument(
        "--seconds", type=float, default=None, help="simulate the arrivals up to this time"
    )
    parser.add_argument(
        "--collector", action="store_true", help="keep the cyclic collector running"
    )
    harness.add_arguments(parser)
    args = parser.parse_args()
    session = harness.Session("sim_speed", args)
    out = run(args.seconds, args.collector)
    print(
        f"scale-1024 from {COMPOSITION}, collector {out['collector']}: {out['requests']:,} "
        f"requests, {out['simulated_s']:.1f} s simulated in {out['wall_s']:.1f} s wall -> "
        f"{out['wall_over_simulated']:.2f}x real time (target: under 1)"
    )
    print(
        f"  collections during the run: {out['collections']}, {out['collections_s']:.1f} s, "
        f"{out['objects_collected']} objects found; reshapes {out['reshapes']}"
    )
    session.finish(args.json, out)


if __name__ == "__main__":
    main()
