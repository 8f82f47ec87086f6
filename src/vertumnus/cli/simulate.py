"""``python -m vertumnus simulate``: a prefill pool at cluster scale, in simulation.

The pool's policy stack (the one the server runs) drives simulated workers whose
prefill times come from a profile (``vertumnus.sim``). Defaults: the preset
``vertumnus``, the shipped Qwen3-30B-A3B / H100 profile, a 40-GPU pool at degrees
{4, 8} starting as 4CP4/3CP8. ``--composition`` also sets the pool size. The
configuration file uses the dialect ``serve`` uses (``vertumnus/config/dialect.py``).
Writes ``DIR/summary.json``, ``requests.jsonl``, ``timeline.csv``,
``ttft_composition.png`` and ``config.json``, and the composition it ends with into
``[pool] state_file`` if one is given (as ``serve`` keeps it); prints a summary.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from vertumnus import native
from vertumnus.cli.args import Renamed
from vertumnus.config import ConfigError
from vertumnus.config.start import write_state
from vertumnus.perfmodel import ProfileError
from vertumnus.policy.placement.routers import ROUTERS
from vertumnus.policy.pool_config import PRESETS
from vertumnus.sim.simulator import Simulation, terminal_progress
from vertumnus.sim.time_model import SimulationError
from vertumnus.sim.workload import WorkloadError
from vertumnus.slo import SloError
from vertumnus.traces import TraceError


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", type=Path, default=None, metavar="CFG.toml")
    p.add_argument("--trace", type=Path, default=None, help="Mooncake JSONL or Azure CSV")
    p.add_argument(
        "--preset",
        choices=list(PRESETS),
        default=None,
        help="a preset of router, composition and replication (default: vertumnus)",
    )
    p.add_argument("--policy", action=Renamed, new="--preset", help=argparse.SUPPRESS)
    p.add_argument("--router", choices=sorted(ROUTERS), default=None, help="[scheduler] router")
    composition = p.add_mutually_exclusive_group()
    composition.add_argument(
        "--adaptive",
        dest="adaptive",
        action="store_const",
        const=True,
        default=None,
        help="the controller reshapes the pool ([controller] enabled = true)",
    )
    composition.add_argument(
        "--fixed",
        dest="adaptive",
        action="store_const",
        const=False,
        help="a fixed composition ([controller] enabled = false)",
    )
    p.add_argument(
        "--replication",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="the cache manager's replication and reclamation ([cache] replication)",
    )
    p.add_argument("--composition", default=None, help="e.g. 4CP4/3CP8 (sets the pool size)")
    p.add_argument(
        "--profile", default=None, metavar="PROFILE", help="a profile file or a shipped name"
    )
    p.add_argument("--rate-scale", type=float, default=None, help="multiply the arrival rate")
    p.add_argument("--time-scale", type=float, default=None, help="stretch the timeline")
    p.add_argument("--max-requests", type=int, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--out", type=Path, required=True, metavar="DIR")


def run(args: argparse.Namespace) -> int:
    from vertumnus.sim import config as sim_config
    from vertumnus.sim import report

    overrides = {
        "pool": {"composition": args.composition},
        "profile": {"path": args.profile},
        "sim": {"seed": args.seed},
        "workload": {
            "trace": str(args.trace) if args.trace else None,
            "rate_scale": args.rate_scale,
            "time_scale": args.time_scale,
            "max_requests": args.max_requests,
        },
    }
    choices = {
        "scheduler": {"router": args.router},
        "controller": {"enabled": args.adaptive},
        "cache": {"replication": args.replication},
    }
    try:
        cfg = sim_config.load(args.config, overrides, preset=args.preset, choices=choices)
        if cfg.start is not None:
            for why in cfg.start.warnings:
                print(f"warning: {why}", file=sys.stderr)
            print(f"start {cfg.start.composition}, from {cfg.start.origin}", file=sys.stderr)
        for module, how in native.status().items():
            if how != "compiled":  # the same results, slower
                print(f"note: {module} runs {how}", file=sys.stderr)
        sim = Simulation(
            cfg.settings, cfg.profile, cfg.spec, cfg.policy, cfg.requests, terminal_progress
        )
        result = sim.run()
    except (SimulationError, TraceError, WorkloadError, SloError, ProfileError) as exc:
        raise ConfigError(str(exc)) from exc
    state_file = cfg.pool.start.state_file
    if state_file is not None:  # the composition it ends with, for the next start
        try:
            write_state(state_file, sim.policy.lattice.config, sim.policy.lattice.layout())
        except OSError as exc:
            print(f"warning: the state file {state_file} was not written ({exc})", file=sys.stderr)
    summary = report.write(result, cfg, args.out)
    print(
        f"{summary['preset']} on {summary['devices']} devices "
        f"({summary['composition_start']} -> {summary['composition_end']}): "
        f"{summary['completed']}/{summary['requests']} requests"
    )
    print(
        f"TTFT mean {summary['mean_ttft_s']:.3f} s, P50 {summary['p50_ttft_s']:.3f} s, "
        f"P90 {summary['p90_ttft_s']:.3f} s, P99 {summary['p99_ttft_s']:.3f} s"
    )
    print(
        f"token SLO attainment ({summary['slo']}) {summary['token_slo_attainment']:.3f}, "
        f"token hit rate {summary['token_hit_rate']:.3f}, splits {summary['splits']}, "
        f"merges {summary['merges']}, copies {summary['copies']}, reclaims {summary['reclaims']}"
    )
    for phase in summary.get("phases", []):
        print(
            f"  phase {phase['phase']} ({phase['start_s']:.0f}-{phase['end_s']:.0f} s, "
            f"{phase['requests']} requests, mostly {phase['composition']}): TTFT mean "
            f"{phase['mean_ttft_s']:.3f} s, P90 {phase['p90_ttft_s']:.3f} s"
        )
    print(
        f"simulated {summary['simulated_s']:.0f} s in {summary['wall_s']:.1f} s of wall time "
        f"({summary['requests_per_wall_s']:.0f} requests/s); results in {args.out}"
    )
    return 0
