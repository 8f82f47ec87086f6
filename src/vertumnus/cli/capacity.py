"""``python -m vertumnus capacity``: measure kappa_C per degree, write it into a profile.

For each degree of the profile (or ``--degrees``), one simulated FIFO worker with the
profile's service times is driven at increasing load with a length mix (the built-in
Mooncake-conversation sample, or ``--trace``), and the largest window demand at which
it still meets the token-weighted TTFT SLO attainment target is its ``kappa_C``
(see ``vertumnus.capacity``). The SLO is ``--slo`` (default: ``vertumnus.slo``, 5x the
request's isolated prefill time). The profile is updated in place, or written to
``--out``, with each kappa and the window, SLO, target and mix it was measured at.
"""

from __future__ import annotations

import argparse
import datetime as dt
import platform
import sys
from pathlib import Path

from vertumnus.capacity import CapacityError, CapacitySettings, LengthMix, measure_capacity
from vertumnus.cli.args import int_list
from vertumnus.config import ConfigError
from vertumnus.perfmodel import Profile
from vertumnus.slo import SloError, TtftSlo
from vertumnus.traces import TraceError, load_trace

DEFAULTS = CapacitySettings()


def _slo(text: str) -> TtftSlo:
    try:
        return TtftSlo.parse(text)
    except SloError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--profile", type=Path, required=True, metavar="PROFILE", help="a file or a shipped name"
    )
    p.add_argument(
        "--out", type=Path, default=None, metavar="PROFILE.json", help="default: update --profile"
    )
    p.add_argument("--degrees", type=int_list, default=None, help="default: all of the profile's")
    p.add_argument("--window-s", type=float, default=DEFAULTS.window_s, help="window H (s)")
    p.add_argument(
        "--slo",
        type=_slo,
        default=DEFAULTS.slo,
        help="per-request TTFT target: '5x' (x isolated prefill time, the default), "
        "'5x,min=0.5s', or a fixed '2.5s' / '800ms'",
    )
    p.add_argument(
        "--target",
        type=float,
        default=DEFAULTS.target_attainment,
        help="token-weighted SLO attainment to keep (default %(default)s)",
    )
    p.add_argument(
        "--trace",
        type=Path,
        default=None,
        help="take the length mix from a Mooncake JSONL or Azure CSV trace "
        "(default: the built-in Mooncake conversation sample)",
    )
    p.add_argument(
        "--length-scale",
        type=float,
        default=1.0,
        help="multiply the mix's lengths, e.g. 0.0625 for a CPU profile of short inputs",
    )
    p.add_argument("--burstiness", type=float, default=DEFAULTS.burstiness, help="gamma shape")
    p.add_argument("--windows", type=int, default=DEFAULTS.num_windows, help="run length")
    p.add_argument("--seed", type=int, default=DEFAULTS.seed)


def run(args: argparse.Namespace) -> int:
    profile = Profile.load(args.profile)
    degrees = args.degrees or profile.degrees
    missing = sorted(set(degrees) - set(profile.degrees))
    if missing:
        raise ConfigError(f"{args.profile} has no degree(s) {missing} (has {profile.degrees})")
    if args.out is None and not args.profile.is_file():
        raise ConfigError(
            f"--profile {args.profile} is a shipped profile: give --out FILE for the result"
        )
    out = args.out or args.profile
    if not out.parent.is_dir():
        raise ConfigError(f"--out {out}: no directory {out.parent}")
    try:
        mix = LengthMix.from_trace(load_trace(args.trace)) if args.trace else LengthMix.builtin()
        mix = mix.scaled(args.length_scale)
        settings = CapacitySettings(
            window_s=args.window_s,
            slo=args.slo,
            target_attainment=args.target,
            num_windows=args.windows,
            burstiness=args.burstiness,
            seed=args.seed,
        )
    except (CapacityError, TraceError) as exc:
        raise ConfigError(str(exc)) from exc
    print(
        f"{profile.model} on {profile.hardware}: window {settings.window_s:g} s, "
        f"SLO {settings.slo.describe()}, target {settings.target_attainment:g}, "
        f"mix {mix.name} ({len(mix.requests)} requests)"
    )
    print(
        f"{'degree':>6} {'kappa_s':>10} {'util':>6} {'req/s':>9} "
        f"{'attain':>7} {'isolated':>8} {'requests':>8}"
    )
    for degree in degrees:
        result = measure_capacity(profile.predict, profile.degrees, degree, mix, settings)
        profile.capacity[degree] = result.to_json(settings, mix)
        note = "  (capped: met at the highest load tried)" if result.capped else ""
        if result.kappa_s == 0:
            note = "  (misses the target even unloaded)"
        print(
            f"{degree:>6} {result.kappa_s:>10.3f} {result.utilisation:>6.3f} "
            f"{result.request_rate:>9.3f} {result.attainment:>7.3f} "
            f"{result.isolated_attainment:>8.3f} {result.requests:>8}{note}"
        )
    profile.provenance["capacity"] = {
        "command": " ".join(["python -m vertumnus", *sys.argv[1:]]),
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "machine": platform.node(),
        "length_scale": args.length_scale,
    }
    profile.save(out)
    print(f"capacity written to {out}")
    return 0
